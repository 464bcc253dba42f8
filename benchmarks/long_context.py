"""Long sequences: the LM with its sequence split over "context", against the sequence whole.

The LM example at configs/lm_tiny.yaml's shapes (4 layers, d_model 128, 4 heads, rope;
AdamW) on packed rows (segment ids and positions, load-balanced for the context axis),
on 8 devices (8 virtual CPU devices by default):

* ``memory``: the compiled step's peak per device (``strategy.memory_analysis``, no
  step run) with the sequence whole on each replica (8 replicas, one row each) and
  split over ``{"context": 8}`` (one replica, one row: each device holds 1/8 of it),
  with ring and all-gather attention;
* ``speed``: steps/s of ring vs all-gather attention at ``{"context": 8}`` (median of
  interleaved rounds);
* ``equality``: ring attention's forward and gradients (wrt q, k, v) against
  ``jax.nn.dot_product_attention`` on one device, float32, with segment ids, causal;
* ``remat``: compiled peak per device and steps/s of each remat policy of the LM
  (``LMConfig.remat``), the sequence whole, 8 replicas of one row each.

Example::

    python -m benchmarks.long_context                          # all three, S=16384
    python -m benchmarks.long_context --only memory --seq 16384
    python -m benchmarks.long_context --only speed --seq 4096 --remat nothing_saveable
    python -m benchmarks.long_context --only equality --equality-seq 4096
    python -m benchmarks.long_context --only remat --seq 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _setup(devices: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        )


def _lm(seq: int, remat: str, attention: str | None) -> tuple[Any, Any]:
    import functools

    from distrain.models import LMConfig
    from examples.lm.train import Settings, init_state, train_step

    cfg = LMConfig(seq_len=seq, d_model=128, n_layers=4, n_heads=4, remat=remat)
    cfg = type(cfg)(**{**cfg.__dict__, "attention": attention})
    apply_fn, state = init_state(Settings(model=cfg, optimizer="adamw", learning_rate=3e-3))
    return functools.partial(train_step, apply_fn=apply_fn), state


def _rows(seq: int, n: int, context: int) -> dict[str, Any]:
    """``n`` packed rows of random bytes in documents of seq/4 .. seq tokens."""
    import numpy as np

    import distrain as dt

    r = np.random.default_rng(0)
    seg = np.zeros((n, seq), np.int32)
    pos = np.zeros((n, seq), np.int32)
    for i in range(n):
        start, s = 0, 1
        while start < seq:
            length = min(int(r.integers(seq // 4, seq + 1)), seq - start)
            seg[i, start : start + length], pos[i, start : start + length] = s, np.arange(length)
            start, s = start + length, s + 1
    rows = {
        "inputs": r.integers(1, 256, (n, seq)).astype(np.uint8),
        "targets": r.integers(1, 256, (n, seq)).astype(np.uint8),
        "segment_ids": seg,
        "positions": pos,
    }
    return dt.nn.load_balance(rows, context) if context > 1 else rows


def _strategy(context: int) -> Any:
    import jax
    from jax.sharding import PartitionSpec as P

    import distrain as dt

    if context == 1:
        return dt.MirroredStrategy(jax.devices())
    return dt.MirroredStrategy(
        devices_per_replica={"context": context},
        batch_layout={"inputs|targets|segment_ids|positions": P(None, "context")},
    )


def memory(seq: int, remat: str) -> dict[str, Any]:
    """Peak bytes per device: whole sequence per replica vs split over context=8."""
    import jax

    out: dict[str, Any] = {}
    for name, context, attention, rows in (
        ("whole", 1, None, 8),
        ("context8_ring", 8, "ring", 1),
        ("context8_all_gather", 8, "all_gather", 1),
    ):
        strategy = _strategy(context)
        step, state = _lm(seq, remat, attention)
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _rows(seq, rows, context)
        )
        placed = strategy.put_replicated(state)
        batch = strategy.distribute_batch(batch)
        peak = strategy.memory_analysis(step, args=(placed, batch))["peak_bytes"]
        out[name] = peak
        print(f"memory {name:22s} seq {seq}: peak {peak / 2**20:10.1f} MiB per device", flush=True)
    out["ratio_ring"] = out["context8_ring"] / out["whole"]
    out["ratio_all_gather"] = out["context8_all_gather"] / out["whole"]
    print(f"context=8 / whole: ring {out['ratio_ring']:.3f}x, all_gather "
          f"{out['ratio_all_gather']:.3f}x", flush=True)  # fmt: skip
    return out


def speed(seq: int, remat: str, rounds: int, steps: int) -> dict[str, Any]:
    """Steps/s of ring vs all-gather at context=8 (interleaved rounds, median)."""
    import jax

    strategy = _strategy(8)
    batch = strategy.distribute_batch(_rows(seq, 1, 8))
    runs = {}
    for attention in ("ring", "all_gather"):
        step, state = _lm(seq, remat, attention)
        placed = strategy.put_replicated(state)
        placed, _ = strategy.run(step, args=(placed, batch))  # compile
        jax.block_until_ready(placed)
        runs[attention] = [step, placed]
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for attention, run in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                run[1], _metrics = strategy.run(run[0], args=(run[1], batch))
                jax.block_until_ready(run[1])  # bounded steps in flight
            times[attention].append(steps / (time.perf_counter() - start))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = out["ring"] / out["all_gather"]
    rates = f"ring {out['ring']:.3f} steps/s, all_gather {out['all_gather']:.3f} steps/s"
    print(f"speed seq {seq} remat {remat}: {rates}, ring/all_gather {out['ratio']:.2f}x")
    return out


def equality(seq: int) -> dict[str, Any]:
    """Max abs difference of ring attention (context=8) and jax.nn on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import distrain as dt

    r = np.random.default_rng(0)
    b, h, d = 1, 4, 32
    q, k, v, w = (jnp.asarray(r.normal(size=(b, seq, h, d)), jnp.float32) for _ in range(4))
    seg = jnp.asarray(np.repeat(np.arange(8), seq // 8)[None], jnp.int32)  # 8 documents
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]

    def grads(attn: Any) -> Any:
        def loss(q: Any, k: Any, v: Any) -> Any:
            out = attn(q, k, v)
            return (out * w).sum(), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    want = grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True))(
        q, k, v
    )
    mesh = Mesh(np.array(jax.devices()[:8]), ("context",), axis_types=(AxisType.Auto,))
    ring = lambda q, k, v: dt.nn.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg)  # noqa: E731
    with jax.sharding.set_mesh(mesh):
        got = grads(ring)(q, k, v)
    (_, out_w), grad_w = want
    (_, out_g), grad_g = got
    err = {"forward": float(jnp.abs(out_g - out_w).max())}
    for name, a, e in zip("qkv", grad_g, grad_w, strict=True):
        err[f"grad_{name}"] = float(jnp.abs(a - e).max())
    print(f"equality seq {seq} float32, 8 documents, causal, context=8 ring: max abs error "
          + ", ".join(f"{k} {v:.2e}" for k, v in err.items()), flush=True)  # fmt: skip
    return err


def remat(seq: int, rounds: int, steps: int) -> dict[str, Any]:
    """Peak per device and steps/s per remat policy (8 replicas, one row each)."""
    import jax

    from distrain.models import REMAT_POLICIES

    strategy = _strategy(1)
    rows = _rows(seq, 8, 1)
    batch = strategy.distribute_batch(rows)
    runs, out = {}, {}
    for policy in REMAT_POLICIES:
        step, state = _lm(seq, policy, None)
        placed = strategy.put_replicated(state)
        try:
            peak = strategy.memory_analysis(step, args=(placed, batch))["peak_bytes"]
            placed, _ = strategy.run(step, args=(placed, batch))
            jax.block_until_ready(placed)
        except Exception as e:  # a policy the platform cannot compile (host offload)
            out[policy] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"remat {policy}: {out[policy]['error']}", flush=True)
            continue
        runs[policy] = [step, placed]
        out[policy] = {"peak_bytes": peak, "rates": []}
    for _ in range(rounds):
        for policy, run in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                run[1], _m = strategy.run(run[0], args=(run[1], batch))
                jax.block_until_ready(run[1])
            out[policy]["rates"].append(steps / (time.perf_counter() - start))
    for policy in runs:
        r = out[policy]
        r["steps_per_sec"] = statistics.median(r.pop("rates"))
        print(f"remat {policy:16s} seq {seq}: peak {r['peak_bytes'] / 2**20:8.1f} MiB per "
              f"device, {r['steps_per_sec']:.3f} steps/s", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["memory", "speed", "equality", "remat"], default=None)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--equality-seq", type=int, default=4096)
    p.add_argument("--remat", default="none")
    p.add_argument("--speed-remat", default="nothing_saveable")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    _setup(8)
    sys.path.insert(0, os.getcwd())
    result: dict[str, Any] = {}
    if args.only in (None, "memory"):
        result["memory"] = memory(args.seq, args.remat)
    if args.only in (None, "equality"):
        result["equality"] = equality(args.equality_seq)
    if args.only in (None, "speed"):
        result["speed"] = speed(args.seq, args.speed_remat, args.rounds, args.steps)
    if args.only == "remat":
        result["remat"] = remat(args.seq, args.rounds, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
