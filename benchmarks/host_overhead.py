"""Host time per step that distrain adds over a bare ``jax.jit`` call.

The device work is made negligible (a step that adds 1 to a few scalars), so what is
measured is Python and dispatch: a bare ``jax.jit`` call, ``strategy.run`` of the same
step, and ``Trainer.fit`` (batches pre-staged, so no input cost). Each configuration
runs ``--calls`` calls per round; rounds are interleaved and the median per-call time
is reported, with the differences to the bare call (issue 13's targets: run <= bare
+ 15 us, fit <= bare + 30 us).

Example::

    python -m benchmarks.host_overhead --devices 1
    python -m benchmarks.host_overhead --devices 8 --json /tmp/host.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="virtual CPU devices (1 or 8)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 300, 3
    if "jax" not in sys.modules and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax
    import jax.numpy as jnp
    import numpy as np

    import distrain as dt

    devices = jax.devices()[: args.devices]
    one = len(devices) == 1
    strategy = dt.OneDeviceStrategy(devices[0]) if one else dt.MirroredStrategy(devices)

    def step(state, batch):
        new = jax.tree.map(lambda p: p + 1.0, state)
        return new, {"loss": jnp.mean(batch["x"])}

    def fresh_state() -> dict:  # new buffers: every loop donates its state
        return {f"p{i}": jnp.zeros(()) for i in range(8)}

    batch_np = {"x": np.ones((8 * len(devices), 4), np.float32)}
    # The hand-written equivalent: the same step under jit(shard_map) on the same mesh,
    # at most 2 calls in flight (an unbounded queue of collectives deadlocks on CPU).
    from jax.sharding import PartitionSpec as P

    def bare_step(state, batch):  # per-replica scalars get a leading axis to concatenate
        new, metrics = step(state, batch)
        return new, jax.tree.map(lambda m: m[None], metrics)

    bare = jax.jit(
        jax.shard_map(
            bare_step,
            mesh=strategy.mesh,
            in_specs=(P(), P(strategy.axis_name)),
            out_specs=(P(), P(strategy.axis_name)),
            check_vma=False,
        ),
        donate_argnums=0,
    )
    dist_batch = strategy.distribute_batch(batch_np)
    bare_batch = dist_batch.value

    def time_bare(n: int) -> float:
        s = jax.device_put(fresh_state(), strategy.put_replicated(jnp.zeros(())).sharding)
        t = time.perf_counter()
        pending = []
        for _ in range(n):
            s, m = bare(s, bare_batch)
            pending.append(m["loss"])
            if len(pending) > 2:
                pending.pop(0).block_until_ready()
        jax.block_until_ready(s)
        return (time.perf_counter() - t) / n

    def time_run(n: int) -> float:
        s = strategy.put_replicated(fresh_state())
        t = time.perf_counter()
        for _ in range(n):
            s, _ = strategy.run(step, args=(s, dist_batch), donate_argnums=(0,))
        jax.block_until_ready(s)
        return (time.perf_counter() - t) / n

    trainer = dt.Trainer(strategy, step, log_every=10**9)
    staged = dist_batch.value  # a global batch already split over the replicas

    def fit_seconds(n: int) -> float:
        t = time.perf_counter()
        final, _ = trainer.fit(fresh_state(), [staged] * n, steps=n)
        jax.block_until_ready(final)
        return time.perf_counter() - t

    def time_fit(n: int) -> float:
        # Two fits of different lengths: their difference is free of fit's start-up.
        short = fit_seconds(n // 4)
        return (fit_seconds(n) - short) / (n - n // 4)

    configs = {"bare_jit": time_bare, "strategy_run": time_run, "trainer_fit": time_fit}
    for fn in configs.values():  # compile and warm up
        fn(50)
    times: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(args.rounds):
        order = list(configs)[r % len(configs) :] + list(configs)[: r % len(configs)]
        for name in order:
            times[name].append(configs[name](args.calls))
    us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    result = {
        "devices": len(devices),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "us_per_call": us,
        "run_minus_bare_us": us["strategy_run"] - us["bare_jit"],
        "fit_minus_bare_us": us["trainer_fit"] - us["bare_jit"],
    }
    print(
        f"{len(devices)} {jax.default_backend()} device(s), jax {jax.__version__}: "
        f"bare jit {us['bare_jit']:.1f} us/call, strategy.run {us['strategy_run']:.1f} "
        f"(+{result['run_minus_bare_us']:.1f}), Trainer.fit {us['trainer_fit']:.1f} "
        f"(+{result['fit_minus_bare_us']:.1f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
