"""Trainer.fit on an ArrayPipeline against strategy.run on pre-staged batches, per layout.

The MLP 512-2048-10 with Adam, global batch 64, on 8 virtual CPU devices: ``--steps``
steps of ``strategy.run`` over batches placed beforehand, then ``Trainer.fit`` for as
many steps (``--input-mode`` device/host/auto), for one replica per device (k=1) and one
replica over all devices (k=8). Both arms donate the state (``donate_argnums=0`` for
``run``; ``fit`` donates by default), so the ratio compares like with like. Rounds are
interleaved; prints the median steps/s of each arm and fit / run.

Example::

    python -m benchmarks.fit_vs_run --rounds 5 --json benchmarks/results/fit_vs_run.json
    python -m benchmarks.fit_vs_run --input-mode host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-mode", default="auto", choices=["auto", "device", "host"])
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    p.add_argument("--layouts", default=None, help="devices_per_replica values (default 1,D)")
    p.add_argument("--steps", type=int, default=200, help="steps per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if "jax" not in sys.modules and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax
    import numpy as np
    import optax

    import distrain as dt

    devices = jax.devices()[: args.devices]
    layouts = [int(x) for x in (args.layouts or f"1,{len(devices)}").split(",")]

    def state() -> Any:
        k = jax.random.split(jax.random.key(0), 2)
        params = {
            "w0": jax.random.normal(k[0], (512, 2048)) * 0.04,
            "w1": jax.random.normal(k[1], (2048, 10)) * 0.02,
        }
        return dt.TrainState.create(params=params, tx=optax.adam(1e-3))

    def step(state: Any, b: Any) -> Any:
        def loss_fn(p: Any) -> Any:
            logits = jax.nn.relu(b["x"] @ p["w0"]) @ p["w1"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
            return dt.compute_average_loss(ce)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    r = np.random.default_rng(0)
    data = {"x": r.normal(size=(64 * args.steps, 512)).astype(np.float32)}
    data["y"] = r.integers(0, 10, 64 * args.steps).astype(np.int32)
    report: dict[str, Any] = {
        "devices": len(devices),
        "jax": jax.__version__,
        "steps": args.steps,
        "rounds": args.rounds,
        "input_mode": args.input_mode,
        "layouts": {},
    }
    for k in layouts:
        s = dt.MirroredStrategy(devices, devices_per_replica=k)
        rows = [{n: v[i * 64 : (i + 1) * 64] for n, v in data.items()} for i in range(args.steps)]
        batches = [s.distribute_batch(b) for b in rows]
        st = s.put_replicated(state())
        for b in batches[:5]:  # compiles
            st, _ = s.run(step, args=(st, b), donate_argnums=0)
        trainer = dt.Trainer(s, step, log_every=args.steps, input_mode=args.input_mode)
        pipe = dt.data.ArrayPipeline(data, global_batch_size=64, seed=0, num_epochs=None)
        # One state object for every fit (fit copies it): a new optax transformation is
        # a new static part of the state, and the step would compile again in the timing.
        initial = state()
        trainer.fit(initial, pipe, steps=10)  # compiles
        run_rates, fit_rates = [], []
        for _ in range(args.rounds):
            jax.block_until_ready(st)
            t = time.perf_counter()
            for b in batches:
                st, _ = s.run(step, args=(st, b), donate_argnums=0)
            jax.block_until_ready(st)
            run_rates.append(args.steps / (time.perf_counter() - t))
            t = time.perf_counter()
            final, _ = trainer.fit(initial, pipe, steps=args.steps)
            jax.block_until_ready(final)
            fit_rates.append(args.steps / (time.perf_counter() - t))
        run, fit = statistics.median(run_rates), statistics.median(fit_rates)
        report["layouts"][str(k)] = {
            "input_mode": trainer.input_mode,
            "run_steps_per_s": run_rates,
            "fit_steps_per_s": fit_rates,
            "fit_over_run": [f / r for f, r in zip(fit_rates, run_rates, strict=True)],
        }
        print(
            f"k={k} ({trainer.input_mode} input): run {run:.0f} steps/s, fit {fit:.0f} "
            f"steps/s, fit/run {fit / run:.2f} (median of {args.rounds} rounds)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
