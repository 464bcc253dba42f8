"""Trainer.fit on an ArrayPipeline against strategy.run on pre-staged batches, per layout.

The MLP 512-2048-10 with Adam, global batch 64, on 8 virtual CPU devices: 100 steps of
``strategy.run`` over batches placed beforehand, then ``Trainer.fit`` for 200 steps
(``--input-mode`` device/host/auto), for one replica per device (k=1) and one replica
over all 8 (k=8). Prints steps/s and fit / run.

Example::

    python -m benchmarks.fit_vs_run
    python -m benchmarks.fit_vs_run --input-mode host
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-mode", default="auto", choices=["auto", "device", "host"])
    p.add_argument("--layouts", default="1,8", help="devices_per_replica values")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import numpy as np
    import optax

    import distrain as dt

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
    data = {"x": r.normal(size=(6400, 512)).astype(np.float32)}
    data["y"] = r.integers(0, 10, 6400).astype(np.int32)
    for k in (int(x) for x in args.layouts.split(",")):
        s = dt.MirroredStrategy(devices_per_replica=k)
        st = s.put_replicated(state())
        rows = [{n: v[i * 64 : (i + 1) * 64] for n, v in data.items()} for i in range(100)]
        batches = [s.distribute_batch(b) for b in rows]
        for b in batches[:5]:
            st, _ = s.run(step, args=(st, b))
        jax.block_until_ready(st)
        t = time.perf_counter()
        for b in batches:
            st, _ = s.run(step, args=(st, b))
        jax.block_until_ready(st)
        run = 100 / (time.perf_counter() - t)
        trainer = dt.Trainer(s, step, log_every=100, input_mode=args.input_mode)
        pipe = dt.data.ArrayPipeline(data, global_batch_size=64, seed=0, num_epochs=None)
        # One state object for both fits (fit copies it): a new optax transformation is
        # a new static part of the state, and the step would compile again in the timing.
        initial = state()
        trainer.fit(initial, pipe, steps=10)  # compiles
        t = time.perf_counter()
        trainer.fit(initial, pipe, steps=200)
        fit = 200 / (time.perf_counter() - t)
        print(
            f"k={k} ({trainer.input_mode} input): run {run:.0f} steps/s, fit {fit:.0f} "
            f"steps/s, fit/run {fit / run:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
