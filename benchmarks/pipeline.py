"""Pipeline stages: steps/s, the schedule's bubble and the compiled memory per device.

A stack of L=8 tanh layers (width 512, batch 64) on 8 virtual CPU devices: one replica
per device without pipelining, against ``{"stage": 4}`` x 2 replicas with M in
{4, 8, 16} microbatches (``dt.nn.pipeline``), stacked parameters laid out
``P("stage")``. Reported per configuration: median steps/s over interleaved rounds, the
ticks of the schedule (M R + S - 1) and the bubble it implies ((S - 1) / (M R + S - 1)),
the compiled step's per-device peak and argument bytes
(``strategy.memory_analysis``) and the bytes its all-reduces move per device (the
gradients' across the 2 replicas, and the pipeline's own: none since its outputs stay
split over the stages).

On virtual CPU devices the stages do not run in parallel (8 devices share the
machine's cores), so steps/s here measure the schedule's total work (the bubble's ticks
compute on padding too), not the overlap a pipeline gets on separate accelerators.

Example::

    python -m benchmarks.pipeline --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from typing import Any

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s8": 1, "u8": 1}


def all_reduce_bytes(hlo: str) -> int:
    """Bytes of the all-reduce results in optimized HLO text, each counted once (the
    schedule's all-reduces are outside its loop; the gradients' too)."""
    total = 0
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-reduce", 1)[0]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import distrain as dt
    from distrain.nn import pipeline

    layers, d, rows, stages = 8, args.width, 64, 4
    k = jax.random.split(jax.random.key(0), 2)
    params = {
        "w": jax.random.normal(k[0], (layers, d, d)) * d**-0.5,
        "b": jnp.zeros((layers, d)),
    }
    x = jax.random.normal(k[1], (rows, d))

    def layer(p: Any, h: Any) -> Any:
        return jnp.tanh(h @ p["w"] + p["b"])

    def make_step(microbatches: int | None) -> Any:
        def step(state: Any, batch: Any) -> Any:
            def loss_fn(p: Any) -> Any:
                if microbatches is None:
                    h = jax.lax.scan(lambda h, q: (layer(q, h), None), batch, p)[0]
                else:
                    h = pipeline(layer, p, batch, microbatches=microbatches)
                return dt.compute_average_loss((h**2).mean(-1))

            loss, g = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=g), loss

        return step

    configs: dict[str, Any] = {"mirrored": (dt.MirroredStrategy(), None)}
    for m in (4, 8, 16):
        s = dt.MirroredStrategy(devices_per_replica={"stage": stages}, layout={"w|b": P("stage")})
        configs[f"stage{stages}_M{m}"] = (s, m)
    prepared = {}
    for name, (s, m) in configs.items():
        with s.scope():
            state = s.put_replicated(dt.TrainState.create(params=params, tx=optax.adam(1e-3)))
            batch = s.distribute_batch(x)
            step = make_step(m)
            memory = s.memory_analysis(step, args=(state, batch))
            memory["all_reduce_bytes"] = all_reduce_bytes(s.compile(step, (state, batch)).as_text())
            state, _ = s.run(step, args=(state, batch))
            jax.block_until_ready(state)
        prepared[name] = [s, step, state, batch, memory, []]
    for _ in range(args.rounds):
        for entry in prepared.values():
            s, step, state, batch, _, times = entry
            start = time.perf_counter()
            for _ in range(args.steps):
                state, _ = s.run(step, args=(state, batch))
            jax.block_until_ready(state)
            times.append(args.steps / (time.perf_counter() - start))
            entry[2] = state
    report = {}
    for name, (_, _, _, _, memory, times) in prepared.items():
        m = configs[name][1]
        ticks = None if m is None else m + stages - 1
        report[name] = {
            "steps_per_s": statistics.median(times),
            "ticks": ticks,
            "bubble_theory": None if m is None else (stages - 1) / ticks,
            "peak_bytes": memory["peak_bytes"],
            "argument_bytes": memory["argument_bytes"],
            "all_reduce_bytes": memory["all_reduce_bytes"],
        }
        bubble = (
            ""
            if m is None
            else f", {ticks} ticks, bubble (S-1)/(M+S-1) = {(stages - 1) / ticks:.3f}"
        )
        print(
            f"{name:>14}: {report[name]['steps_per_s']:7.1f} steps/s, peak "
            f"{memory['peak_bytes'] / 2**20:6.2f} MiB/device, arguments "
            f"{memory['argument_bytes'] / 2**20:6.2f} MiB/device, all-reduced "
            f"{memory['all_reduce_bytes'] / 2**20:6.2f} MiB/device/step{bubble}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
