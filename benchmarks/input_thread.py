"""A slow streaming source with and without the prefetch thread (``InputOptions``).

``Trainer.fit`` trains the suite's MLP (``benchmarks/workloads.py``: 784-256-256-10,
batch 512) on batches from a generator that spends ``--read-ms`` per batch (on top of
handing out one of eight pre-made batches), either waiting (I/O: ``time.sleep``, which
releases the GIL, as file and network reads do) or in small NumPy operations (which
mostly hold it).
Rounds alternate ``prefetch_thread=True`` and ``False``; the median steps/s of each
and their per-round ratio are printed.

Example::

    python -m benchmarks.input_thread --devices 1 --read-ms 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--read-ms", type=float, default=5.0, help="source time per batch")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 8, 1
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax
    import numpy as np

    import distrain as dt
    from benchmarks.loops import NUM_STAGED, _initial_state, _trainer_step
    from benchmarks.workloads import WORKLOADS, host_batches

    workload = WORKLOADS["mlp"]  # the suite's MLP, its step and its synthetic batches
    strategy = dt.MirroredStrategy(jax.devices()[: args.devices])
    step = _trainer_step(workload)
    pool = host_batches(workload, NUM_STAGED)

    def source(kind: str):
        for i in itertools.count():
            t = time.perf_counter()
            batch = pool[i % len(pool)]
            if kind == "io":
                time.sleep(args.read_ms / 1e3)
            else:  # NumPy work on a small array until the budget is spent
                y = np.ones(4096, np.float32)
                while time.perf_counter() - t < args.read_ms / 1e3:
                    y = np.sqrt(y * y + 1e-3)
            yield batch

    def steps_per_sec(kind: str, thread: bool) -> float:
        data = strategy.experimental_distribute_dataset(
            source(kind), dt.InputOptions(prefetch_thread=thread)
        )
        state = strategy.put_replicated(_initial_state(workload))
        trainer = dt.Trainer(strategy, step, log_every=10**9)
        state, _ = trainer.fit(state, data, steps=3)  # compile
        jax.block_until_ready(state)
        t = time.perf_counter()
        state, _ = trainer.fit(state, data, steps=args.steps)
        jax.block_until_ready(state)
        return args.steps / (time.perf_counter() - t)

    results: dict[str, object] = {"devices": args.devices, "read_ms": args.read_ms}
    for kind in ("io", "numpy"):
        rows: dict[bool, list[float]] = {True: [], False: []}
        ratios = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {thread: steps_per_sec(kind, thread) for thread in order}
            for thread, v in got.items():
                rows[thread].append(v)
            ratios.append(got[True] / got[False])
        with_t, without = statistics.median(rows[True]), statistics.median(rows[False])
        ratio = statistics.median(ratios)
        results[kind] = {"thread": with_t, "no_thread": without, "ratio": ratio}
        print(
            f"{kind:5s} source, {args.read_ms:g} ms per batch: prefetch thread "
            f"{with_t:.1f} steps/s, caller's thread {without:.1f} steps/s, x {ratio:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
