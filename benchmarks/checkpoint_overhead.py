"""What asynchronous checkpointing costs a training loop (MNIST-MLP sized).

Trains the 784-256-256-10 MLP with Adam (global batch 512, random data) and measures:

* steps/s of the step loop without checkpoints, and with ``dt.checkpoint.CheckpointManager``
  saving asynchronously every ``--every`` steps (the loop calls ``save`` every step,
  as a Trainer would; it writes every ``--every``-th);
* the CPU time of this process per step, in both variants: unlike steps/s it does not
  depend on what else runs on the machine;
* the wall time of one save (how long ``save`` blocks the loop, and until the write
  is committed) and of one restore onto the same placement.

Runs with ``dt.MirroredStrategy`` on ``--devices`` virtual CPU devices (default 8,
as the Trainer benchmarks) or, with ``--devices 1``, a plain ``jax.jit`` loop on one
device. Loop runs alternate between the two variants, ``--repeats`` times each, and
the medians are reported, because neighbours on a shared machine make single runs
noisy.

Usage:
  python benchmarks/checkpoint_overhead.py [--devices 8] [--steps 500] [--every 100] [--repeats 5]
      [--json PATH]

Prints a table and one JSON line; also writes the JSON to ``--json`` (default
benchmarks/results/checkpoint_overhead.json, the figure in docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--json", default=None, help="write the results here (default: results/)")
    args = p.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
        )
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import distrain as dt
    from distrain.checkpoint import CheckpointManager

    sizes = (784, 256, 256, 10)
    key = jax.random.key(0)
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, k = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(k, (m, n)) * (2.0 / m) ** 0.5
        params[f"b{i}"] = jnp.zeros(n)
    tx = optax.adam(1e-3)
    rs = np.random.default_rng(0)
    x = rs.normal(size=(args.batch, 784)).astype(np.float32)
    y = rs.integers(0, 10, size=args.batch).astype(np.int32)

    def loss_fn(params, x, y, scale):
        h = x
        for i in range(len(sizes) - 1):
            h = h @ params[f"w{i}"] + params[f"b{i}"]
            if i < len(sizes) - 2:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).sum() * scale

    if args.devices == 1:
        state = dt.TrainState.create(params=params, tx=tx)
        batch = (jnp.asarray(x), jnp.asarray(y))

        @jax.jit
        def jit_step(state, x, y):
            loss, g = jax.value_and_grad(loss_fn)(state.params, x, y, 1.0 / args.batch)
            return state.apply_gradients(grads=g), loss

        in_flight: list = []

        def step(state):
            state, loss = jit_step(state, *batch)
            in_flight.append(loss)
            if len(in_flight) > 2:  # bound the steps in flight, as the Trainer does
                in_flight.pop(0).block_until_ready()
            return state

        setting = "jax.jit, 1 CPU device"
    else:
        strategy = dt.MirroredStrategy(jax.devices()[: args.devices])
        with strategy.scope():
            state = strategy.put_replicated(dt.TrainState.create(params=params, tx=tx))
            batch = strategy.distribute_batch({"x": x, "y": y})

        def replica_step(state, b):
            loss, g = jax.value_and_grad(loss_fn)(state.params, b["x"], b["y"], 1.0 / args.batch)
            return state.apply_gradients(grads=g), loss

        def step(state):
            with strategy.scope():
                return strategy.run(replica_step, args=(state, batch))[0]

        setting = f"dt.MirroredStrategy, {args.devices} virtual CPU devices"

    root = Path(tempfile.mkdtemp(prefix="distrain-ckpt-bench-"))

    def loop(state, n, mgr):
        """Returns (steps/s of wall time, CPU seconds of this process per step, state)."""
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(1, n + 1):
            state = step(state)
            if mgr is not None:
                mgr.save(i, state)
        jax.block_until_ready(state)
        if mgr is not None:
            mgr.wait_until_finished()  # the last write counts too
        return n / (time.perf_counter() - start), (time.process_time() - cpu) / n, state

    try:
        _, _, state = loop(state, 20, None)  # compile and warm up
        with CheckpointManager(root / "warm", save_interval_steps=10) as mgr:
            loop(state, 20, mgr)
        plain, ckpt, plain_cpu, ckpt_cpu = [], [], [], []
        for r in range(args.repeats):
            sps, cpu, state = loop(state, args.steps, None)
            plain.append(sps)
            plain_cpu.append(cpu)
            with CheckpointManager(root / f"run{r}", save_interval_steps=args.every) as mgr:
                sps, cpu, state = loop(state, args.steps, mgr)
            ckpt.append(sps)
            ckpt_cpu.append(cpu)

        # One save and one restore, timed on their own.
        blocking, total, restore = [], [], []
        with CheckpointManager(root / "timing", max_to_keep=2) as mgr:
            for s in range(1, 4):
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                mgr.save(s, state)
                t1 = time.perf_counter()
                mgr.wait_until_finished()
                t2 = time.perf_counter()
                blocking.append(t1 - t0)
                total.append(t2 - t0)
                t0 = time.perf_counter()
                restored = mgr.restore(target=state)
                jax.block_until_ready(restored.state)
                restore.append(time.perf_counter() - t0)
        nbytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(state))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    result = {
        "benchmark": "checkpoint_overhead",
        "setting": setting,
        "model": f"MLP 784-256-256-10, Adam, global batch {args.batch}",
        "state_mb": round(nbytes / 2**20, 2),
        "steps": args.steps,
        "save_every": args.every,
        "repeats": args.repeats,
        "steps_per_s_no_ckpt": round(statistics.median(plain), 1),
        "steps_per_s_async_ckpt": round(statistics.median(ckpt), 1),
        "overhead_pct": round(100 * (1 - statistics.median(ckpt) / statistics.median(plain)), 2),
        # CPU time of this process (all threads, including the background writer) per
        # step: insensitive to other processes competing for the cores.
        "cpu_ms_per_step_no_ckpt": round(1000 * statistics.median(plain_cpu), 3),
        "cpu_ms_per_step_async_ckpt": round(1000 * statistics.median(ckpt_cpu), 3),
        "cpu_overhead_pct": round(
            100 * (statistics.median(ckpt_cpu) / statistics.median(plain_cpu) - 1), 2
        ),
        "load_average_1min": round(os.getloadavg()[0], 1),
        "save_blocking_ms": round(1000 * statistics.median(blocking), 1),
        "save_until_committed_ms": round(1000 * statistics.median(total), 1),
        "restore_ms": round(1000 * statistics.median(restore), 1),
        "all_runs_steps_per_s": {"no_ckpt": plain, "async_ckpt": ckpt},
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
    }
    print(f"checkpoint overhead: {result['model']}; {setting}; state {result['state_mb']} MiB")
    print(f"{'':34}{'value':>10}")
    rows = [
        ("steps/s, no checkpoints", result["steps_per_s_no_ckpt"]),
        (f"steps/s, async save every {args.every}", result["steps_per_s_async_ckpt"]),
        ("overhead, wall clock (%)", result["overhead_pct"]),
        ("CPU ms/step, no checkpoints", result["cpu_ms_per_step_no_ckpt"]),
        ("CPU ms/step, async checkpoints", result["cpu_ms_per_step_async_ckpt"]),
        ("overhead, CPU time (%)", result["cpu_overhead_pct"]),
        ("save: blocks the loop (ms)", result["save_blocking_ms"]),
        ("save: until committed (ms)", result["save_until_committed_ms"]),
        ("restore (ms)", result["restore_ms"]),
    ]
    for name, value in rows:
        print(f"{name:34}{value:>10}")
    print(json.dumps(result))
    out = Path(args.json or Path(__file__).parent / "results" / "checkpoint_overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
