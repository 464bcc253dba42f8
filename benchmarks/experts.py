"""Mixture of experts (``dt.nn.moe``, the LM example's ``moe_experts``): memory, speed and
balance.

``python -m benchmarks.experts [--json benchmarks/results/experts.json] [--toy]``

* **Memory**: the expert parameters one device holds on a replica ``{"expert": X}``
  (``distrain.models.EXPERT_LAYOUT``), against one device holding them all (target:
  ``1 / X`` within 5%), from the placed arrays' shards.
* **Speed**: ``Trainer.fit`` tokens/s of the MoE LM against the dense LM with the same
  active parameters (the dense MLP ``moe_top_k`` times as wide), one device, batches
  pre-staged; interleaved rounds, medians, and the median of per-round ratios.
* **Balance**: the MoE LM trained on real text (the Python standard library's sources,
  as the LM example) with the load-balancing loss at weight 0.01 and at 0, and with
  DeepSeek-V3's selection bias (``moe_balance="bias"``, no loss): the experts' load's
  coefficient of variation (``moe_load_cv``, over the blocks) by log window, and the
  held-out loss at the end.

Prints a table and writes the JSON (``--json``). ``--balance-only bias`` (arms, comma
separated) runs only those balance arms and replaces them in the ``--json`` file, the
rest of which it keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if "jax" not in sys.modules and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    # 8 virtual CPU devices for the expert axes of the memory table.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is importable from the repository root

import distrain as dt  # noqa: E402
from benchmarks.loops import Forever  # noqa: E402
from distrain.models import EXPERT_LAYOUT, LMConfig, count_params  # noqa: E402
from examples.lm import data as lm_data  # noqa: E402
from examples.lm.train import Settings, eval_step, init_state, train_step  # noqa: E402

MOE = LMConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4, d_ff=256, moe_experts=8)


def settings(cfg: LMConfig, batch: int, lr: float = 3e-3) -> Settings:
    return Settings(model=cfg, global_batch_size=batch, eval_batch_size=batch, learning_rate=lr)


def memory(cfg: LMConfig, axes: list[int]) -> list[dict[str, Any]]:
    """Expert bytes on device 0 with the experts over ``{"expert": X}``, per X."""
    _, state = init_state(settings(cfg, 8))
    rows = []
    for x in axes:
        strategy = dt.MirroredStrategy(
            jax.devices()[:x], devices_per_replica={"expert": x}, layout=EXPERT_LAYOUT
        )
        params = strategy.put_replicated(state).params
        experts = [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            if jax.tree_util.keystr(path, simple=True, separator="/").endswith(("w_in", "w_out"))
        ]
        whole = sum(a.nbytes for a in experts)
        here = sum(a.addressable_shards[0].data.nbytes for a in experts)
        rows.append(
            {
                "expert_axis": x,
                "bytes_one_device": whole,
                "bytes_per_device": here,
                "fraction": here / whole,
                "target": 1 / x,
            }
        )
    return rows


class Fit:
    """``Trainer.fit`` of one config on one device, timed by ``dt.callbacks.Throughput``."""

    def __init__(self, cfg: LMConfig, batch: int) -> None:
        s = settings(cfg, batch)
        apply_fn, state = init_state(s)
        self.batch, self.tokens = batch, batch * cfg.seq_len
        self.strategy = dt.OneDeviceStrategy(jax.devices()[0])
        self.step = functools.partial(train_step, apply_fn=apply_fn)
        self.state = self.strategy.put_replicated(state)
        rng = np.random.default_rng(0)
        shape = (batch, cfg.seq_len + 1)
        self.data = Forever([{"tokens": rng.integers(0, 256, shape, dtype=np.uint8)}] * 4)

    def tokens_per_sec(self, steps: int) -> float:
        k = max(1, steps // 4)
        steps -= steps % k
        tp = dt.callbacks.Throughput(self.batch)
        trainer = dt.Trainer(self.strategy, self.step, log_every=k, callbacks=[tp])
        self.state, _ = trainer.fit(self.state, self.data, steps=k + steps)
        summary = tp.summary()
        assert summary is not None and summary["steps"] == steps
        return steps * self.tokens / summary["seconds"]


def speed(cfg: LMConfig, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    dense_cfg = dataclasses.replace(cfg, moe_experts=None, d_ff=cfg.ff * cfg.moe_top_k)
    loops = {"moe": Fit(cfg, batch), "dense": Fit(dense_cfg, batch)}
    for loop in loops.values():
        loop.tokens_per_sec(4)  # compile and warm up
    tps: dict[str, list[float]] = {n: [] for n in loops}
    for r in range(rounds):
        for name in list(loops)[r % 2 :] + list(loops)[: r % 2]:
            tps[name].append(loops[name].tokens_per_sec(steps))
    return {
        "active_matmul_params": {
            "moe": count_params(cfg)["matmul"],
            "dense": count_params(dense_cfg)["matmul"],
        },
        "tokens_per_sec": {n: statistics.median(v) for n, v in tps.items()},
        "tokens_per_sec_rounds": tps,
        "moe_vs_dense": statistics.median(
            m / d for m, d in zip(tps["moe"], tps["dense"], strict=True)
        ),
    }


# The balancing arms: LMConfig fields over MOE's. The Switch loss (weight 0.01), no
# balancing, and DeepSeek-V3's selection bias at its own rate (0.001), with no loss.
ARMS: dict[str, dict[str, Any]] = {
    "balance_loss_0.01": {"moe_balance_weight": 0.01},
    "balance_loss_0": {"moe_balance_weight": 0.0},
    "bias": {"moe_balance": "bias", "moe_bias_rate": 1e-3},
}


def balance(
    cfg: LMConfig,
    batch: int,
    steps: int,
    log_every: int,
    documents: int,
    arms: list[str],
) -> dict[str, Any]:
    """Each arm trained ``steps`` steps from the same initialisation and data order; its
    load's CV by log window and its held-out loss (the corpus's held-out documents) at
    the end."""
    # A few documents need a larger held-out share to split at all.
    corpus = lm_data.python_corpus(0.01 if documents >= 400 else 0.2, max_documents=documents)
    rows = {"tokens": lm_data.pack(corpus["train"], cfg.seq_len)}
    heldout = {"tokens": lm_data.pack(corpus["test"], cfg.seq_len, max_rows=64 * batch)}
    out = {}
    for name in arms:
        c = dataclasses.replace(cfg, **ARMS[name])
        apply_fn, state = init_state(settings(c, batch))
        cv: list[float] = []
        trainer = dt.Trainer(
            dt.OneDeviceStrategy(jax.devices()[0]),
            functools.partial(train_step, apply_fn=apply_fn),
            functools.partial(eval_step, apply_fn=apply_fn),
            log_every=log_every,
            callbacks=[
                dt.callbacks.LambdaCallback(
                    on_train_batch_end=lambda info, cv=cv: (
                        info.logs is not None and cv.append(float(info.logs["moe_load_cv"]))
                    )
                )
            ],
        )
        data = dt.data.ArrayPipeline(rows, global_batch_size=batch, seed=0, num_epochs=None)
        state, _ = trainer.fit(state, data, steps=steps)
        test = dt.data.ArrayPipeline(heldout, global_batch_size=batch, num_epochs=1)
        loss = trainer.evaluate(state, test)["loss"]
        out[name] = {
            "fields": ARMS[name],
            "moe_load_cv_by_window": cv,
            "first": cv[0],
            "last": cv[-1],
            "heldout_loss": float(loss),
            "heldout_tokens": int(heldout["tokens"].shape[0] * cfg.seq_len),
        }
    return {"steps": steps, "log_every": log_every, "runs": out}


def table(result: dict[str, Any]) -> str:
    lines = ["expert axis  expert bytes/device  of one device  target"]
    for r in result["memory"]:
        lines.append(
            f"{r['expert_axis']:>11}  {r['bytes_per_device']:>19,}  {r['fraction']:>13.4f}"
            f"  {r['target']:.4f}"
        )
    s = result["speed"]
    lines.append(
        f"tokens/s (one device): MoE {s['tokens_per_sec']['moe']:,.0f}, dense with equal active "
        f"parameters {s['tokens_per_sec']['dense']:,.0f}: MoE {s['moe_vs_dense']:.3f}x"
    )
    for name, run in result["balance"]["runs"].items():
        heldout = f", held-out loss {run['heldout_loss']:.4f}" if "heldout_loss" in run else ""
        lines.append(f"expert load CV, {name}: {run['first']:.3f} -> {run['last']:.3f}{heldout}")
    return "\n".join(lines)


def _balance_only(args: argparse.Namespace, cfg: LMConfig, command: str) -> dict[str, Any]:
    """``--balance-only``: the named arms, replaced in the ``--json`` file's balance runs."""
    arms = args.balance_only.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--balance-only: unknown arm(s) {unknown}; choose among {list(ARMS)}.")
    if not args.json or not Path(args.json).exists():
        raise SystemExit(
            "--balance-only replaces runs in an existing result: pass --json FILE of a full run."
        )
    result = json.loads(Path(args.json).read_text())
    steps, log_every = result["balance"]["steps"], result["balance"]["log_every"]
    load_before = os.getloadavg()
    new = balance(cfg, 16, steps, log_every, documents=400, arms=arms)["runs"]
    for run in new.values():
        run.update(command=command, jax=jax.__version__, date=time.strftime("%Y-%m-%d"))
        run["load_average_before_after"] = [list(load_before), list(os.getloadavg())]
    result["balance"]["runs"].update(new)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--toy", action="store_true", help="a few steps: the smoke test")
    p.add_argument(
        "--balance-only",
        default=None,
        metavar="ARMS",
        help=f"only these balance arms (comma separated, of {list(ARMS)}), merged into --json",
    )
    args = p.parse_args(argv)
    cfg = MOE if not args.toy else dataclasses.replace(MOE, seq_len=16, d_model=32, n_heads=2)
    command = "python -m benchmarks.experts " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.balance_only is not None:
        result = _balance_only(args, cfg, command)
    else:
        axes = [x for x in (2, 4, 8) if x <= jax.device_count() and cfg.moe_experts % x == 0]
        result = {
            "command": command,
            "model": dataclasses.asdict(cfg),
            "jax": jax.__version__,
            "device_kind": jax.devices()[0].device_kind,
            "host": {"machine": platform.machine(), "python": platform.python_version()},
            "memory": memory(cfg, axes),
            "speed": speed(cfg, 8 if args.toy else 16, 4 if args.toy else 20, 1 if args.toy else 5),
            "balance": balance(
                cfg,
                8 if args.toy else 16,
                8 if args.toy else 600,
                4 if args.toy else 50,
                documents=40 if args.toy else 400,
                arms=list(ARMS),
            ),
        }
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
