"""The LM of ``examples/lm`` three ways: a hand-written ``jax.jit`` loop, ``strategy.run``
and ``Trainer.fit``, on the same model and batches: tokens/s and MFU.

``python -m benchmarks.lm [--config configs/lm_tiny.yaml] [--steps 8] [--repeats 5]``

* ``jax_jit``: ``jax.jit(step, donate_argnums=0)`` with the batch split over the local
  devices (``NamedSharding``, XLA inserts the gradient all-reduce) and the token-mean
  loss written directly: the floor any framework is measured against;
* ``strategy_run``: ``dt.MirroredStrategy().run(examples.lm.train.train_step, ...)`` on
  pre-staged per-replica batches, state donated;
* ``trainer_fit``: ``dt.Trainer(strategy, train_step).fit(...)``, timed by
  ``dt.callbacks.Throughput`` (between the Trainer's own metric syncs, compilation
  excluded).

Each configuration is compiled and warmed up first; then ``--repeats`` rounds time
``--steps`` steps of each in turn (rotating the order). Reported: the median tokens/s
of each, and the median of the per-round ratios to ``jax_jit`` (a slow spell of a
shared machine hits one round's three alike). Batches are random bytes (throughput does not
depend on the values). MFU needs a peak: the table of ``dt.callbacks.Throughput``
(H100, H200, A100, TPU v4/v5e) or ``--peak-flops``; on CPU it is reported as ``None``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is importable from the repository root

import distrain as dt  # noqa: E402
from benchmarks.loops import Forever  # noqa: E402
from distrain._src.train.callbacks.throughput import peak_flops_per_device  # noqa: E402
from distrain.models import flops_per_token  # noqa: E402
from examples.lm.train import Settings, init_state, settings_from_config, train_step  # noqa: E402

NUM_STAGED = 4  # distinct batches cycled through
CONFIGS = ("jax_jit", "strategy_run", "trainer_fit")


def _batches(s: Settings, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    shape = (s.global_batch_size, s.model.seq_len + 1)
    return [{"tokens": rng.integers(0, 256, shape, dtype=np.uint8)} for _ in range(n)]


class JaxJit:
    """The hand-written loop: one ``jax.jit`` step, data-parallel by sharding annotations."""

    def __init__(self, s: Settings) -> None:
        apply_fn, state = init_state(s)
        tx = state.tx
        mesh = Mesh(np.array(jax.devices()), ("data",))
        replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
            tokens = batch["tokens"].astype(jnp.int32)

            def loss_fn(params: Any) -> jax.Array:
                logits = apply_fn(params, tokens[:, :-1])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
                return jnp.mean(ce)

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss

        self.step = step
        self.state = jax.device_put(state, replicated)
        self.batches = [jax.device_put(b, split) for b in _batches(s, NUM_STAGED)]

    def time(self, steps: int) -> float:
        state, step, batches = self.state, self.step, self.batches
        jax.block_until_ready(state)
        start = time.perf_counter()
        for i in range(steps):
            state, _ = step(state, batches[i % NUM_STAGED])
        jax.block_until_ready(state)
        self.state = state
        return time.perf_counter() - start


class StrategyRun:
    """``strategy.run(train_step, ...)`` on pre-staged per-replica batches."""

    def __init__(self, s: Settings) -> None:
        apply_fn, state = init_state(s)
        self.strategy = dt.MirroredStrategy()
        self.step = functools.partial(train_step, apply_fn=apply_fn)
        self.state = self.strategy.put_replicated(state)
        self.batches = [self.strategy.distribute_batch(b) for b in _batches(s, NUM_STAGED)]

    def time(self, steps: int) -> float:
        state, run, step, batches = self.state, self.strategy.run, self.step, self.batches
        jax.block_until_ready(state)
        start = time.perf_counter()
        for i in range(steps):
            state, _ = run(step, args=(state, batches[i % NUM_STAGED]), donate_argnums=(0,))
        jax.block_until_ready(state)
        self.state = state
        return time.perf_counter() - start


class TrainerFit:
    """``Trainer.fit``, timed by ``dt.callbacks.Throughput`` inside one ``fit`` call."""

    def __init__(self, s: Settings) -> None:
        apply_fn, state = init_state(s)
        self.s = s
        self.strategy = dt.MirroredStrategy()
        self.step = functools.partial(train_step, apply_fn=apply_fn)
        self.state = self.strategy.put_replicated(state)
        staged = [self.strategy.distribute_batch(b).value for b in _batches(s, NUM_STAGED)]
        self.data = Forever(staged)

    def time(self, steps: int) -> float:
        # Metric syncs every `k` steps; the first window (fit's start-up) only starts the
        # clock, the next `steps` steps are timed.
        k = max(1, steps // 4)
        steps -= steps % k
        tp = dt.callbacks.Throughput(self.s.global_batch_size)
        trainer = dt.Trainer(self.strategy, self.step, log_every=k, callbacks=[tp])
        self.state, _ = trainer.fit(self.state, self.data, steps=k + steps)
        summary = tp.summary()
        assert summary is not None and summary["steps"] == steps
        return summary["seconds"]


def run(
    s: Settings,
    *,
    steps: int,
    repeats: int,
    peak: float | None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Sets up, warms up and times the three loops; returns the JSON-ready results."""
    benches = {"jax_jit": JaxJit(s), "strategy_run": StrategyRun(s), "trainer_fit": TrainerFit(s)}
    for name, b in benches.items():
        t0 = time.perf_counter()
        b.time(2)  # compile and warm up
        log(f"{name}: compiled and warmed up in {time.perf_counter() - t0:.1f} s")
    if steps >= 4:
        steps -= steps % (steps // 4)  # what TrainerFit times: a multiple of its sync interval
    seconds: dict[str, list[float]] = {name: [] for name in benches}
    for r in range(repeats):
        order = list(benches)[r % len(benches) :] + list(benches)[: r % len(benches)]
        for name in order:
            seconds[name].append(benches[name].time(steps))
    tokens_per_step = s.global_batch_size * s.model.seq_len
    fpt = flops_per_token(s.model)
    n = jax.device_count()
    rows = {}
    for name, values in seconds.items():
        tps = steps * tokens_per_step / statistics.median(values)
        rows[name] = {
            "tokens_per_sec": tps,
            "mfu": fpt * tps / (peak * n) if peak else None,
            "seconds": values,
        }
    for name, row in rows.items():
        # The median of per-round ratios: a slow spell of the machine hits one round alike.
        ratios = [j / t for j, t in zip(seconds["jax_jit"], seconds[name], strict=True)]
        row["vs_jax_jit"] = statistics.median(ratios)
    return {
        "model": dataclasses.asdict(s.model),
        "global_batch_size": s.global_batch_size,
        "flops_per_token": fpt,
        "devices": n,
        "device_kind": jax.devices()[0].device_kind,
        "peak_flops_per_device": peak,
        "steps": steps,
        "repeats": repeats,
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "jax": jax.__version__,
        "results": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['devices']} x {result['device_kind']}, batch {result['global_batch_size']} x "
        f"{result['model']['seq_len']} tokens, {result['flops_per_token'] / 1e6:.2f} MFLOPs/token",
        f"{'loop':<14} {'tokens/s':>12} {'MFU':>8} {'vs jax_jit':>11}",
    ]
    for name, r in result["results"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"{name:<14} {r['tokens_per_sec']:>12,.0f} {mfu:>8} {r['vs_jax_jit']:>10.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/lm_tiny.yaml"))
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.global_batch_size=8")
    p.add_argument("--steps", type=int, default=8, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16")
    p.add_argument("--peak-flops", type=float, default=None, help="per device; default: table")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    s = settings_from_config(args.config, args.overrides)
    if args.bf16:
        s.model = dataclasses.replace(s.model, dtype="bfloat16")
    peak = args.peak_flops if args.peak_flops is not None else peak_flops_per_device()
    result = run(s, steps=args.steps, repeats=args.repeats, peak=peak)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
