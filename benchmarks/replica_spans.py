"""A replica that spans k devices: memory per device and steps/s against the floor.

Two workloads on 8 devices (8 virtual CPU devices by default): the MLP 512-2048-10
(Adam, global batch 64) and the LM example's tiny transformer (configs/lm_tiny.yaml's
shapes, AdamW, global batch 32 x 128 bytes). For each k in 1, 2, 4, 8 and the named
mesh ``{"fsdp": 4, "tensor": 2}`` (Megatron rules: the MLP's hidden layer split by
columns then rows over ``"tensor"``, the LM's ``TENSOR_PARALLEL_LAYOUT`` and its
hidden-state constraint), ``MirroredStrategy(devices_per_replica=...)`` trains with
``strategy.run`` (state donated); the floor is a hand-written GSPMD ``jax.jit`` loop
over the same devices with the same specs (the state's shardings from the strategy,
the batch placed as the strategy places it, the same mesh in context so activation
constraints apply, one global-batch step). Reported per configuration: state bytes per
device (``strategy.memory_report``), the compiled step's peak per device
(``strategy.memory_analysis`` with the state donated, as the loops run: argument +
output + temp - alias), median steps/s over
interleaved rounds, and the ratios to mirrored (k=1) and to the floor.

Example::

    python -m benchmarks.replica_spans                   # 8 virtual CPU devices
    python -m benchmarks.replica_spans --json /tmp/spans.json --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _mlp(jax: Any, jnp: Any, optax: Any) -> tuple[Any, Any, Any]:
    sizes = [512, 2048, 10]
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        f"w{i}": jax.random.normal(keys[i], (a, b)) * a**-0.5
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }
    params.update({f"b{i}": jnp.zeros(b) for i, b in enumerate(sizes[1:])})

    def per_example(p: Any, batch: Any) -> Any:
        h = jax.nn.relu(batch["x"] @ p["w0"] + p["b0"])
        logits = h @ p["w1"] + p["b1"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    import numpy as np

    r = np.random.default_rng(0)
    batch = {"x": r.normal(size=(64, 512)).astype(np.float32), "y": r.integers(0, 10, 64)}
    return params, per_example, batch


def _lm(jax: Any, jnp: Any, optax: Any) -> tuple[Any, Any, Any]:
    import numpy as np
    from flax import nnx

    from distrain.models import LMConfig, Transformer, make_apply_fn

    cfg = LMConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    apply_fn = make_apply_fn(graphdef)

    def per_example(p: Any, batch: Any) -> Any:
        logits = apply_fn(p, batch["tokens"][:, :-1]).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        return losses.mean(-1)

    r = np.random.default_rng(0)
    batch = {"tokens": r.integers(0, 256, (32, cfg.seq_len + 1)).astype(np.int32)}
    return nnx.to_pure_dict(params), per_example, batch


# Megatron-style rules for the MLP 512-2048-10 on {"fsdp": 4, "tensor": 2}: the hidden
# layer's columns over "tensor" (its rows FSDP), the output layer's rows over "tensor".
MLP_TENSOR_LAYOUT = {"w0": ("fsdp", "tensor"), "b0": ("tensor",), "w1": ("tensor", None)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (CPU only)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps per timed round")
    p.add_argument("--workloads", default="mlp,lm")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    sys.path.insert(0, os.getcwd())

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import distrain as dt

    results: dict[str, Any] = {"jax": jax.__version__, "devices": jax.device_count()}
    for name in args.workloads.split(","):
        params, per_example, batch = {"mlp": _mlp, "lm": _lm}[name](jax, jnp, optax)
        tx = optax.adam(1e-3) if name == "mlp" else optax.adamw(3e-3, weight_decay=0.01)
        global_batch = len(next(iter(batch.values())))

        def train_step(state: Any, b: Any) -> Any:
            loss_fn = lambda q: dt.compute_average_loss(per_example(q, b))  # noqa: B023
            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss

        def floor_step(state: Any, b: Any) -> Any:  # a global-batch step: plain GSPMD
            loss, grads = jax.value_and_grad(lambda q: per_example(q, b).mean())(state.params)  # noqa: B023
            return state.apply_gradients(grads=grads, all_reduce=False), loss

        if name == "mlp":
            tensor_layout: Any = {k: P(*v) for k, v in MLP_TENSOR_LAYOUT.items()}
        else:
            from distrain.models import TENSOR_PARALLEL_LAYOUT as tensor_layout
        configs: list[tuple[str, Any, Any]] = [
            (f"k={k}", k, None) for k in (1, 2, 4, 8) if jax.device_count() % k == 0
        ]
        if jax.device_count() % 8 == 0:
            configs.append(("fsdp4xtp2", {"fsdp": 4, "tensor": 2}, tensor_layout))
        runs: dict[str, Any] = {}
        for key, dpr, layout in configs:
            strategy = dt.MirroredStrategy(devices_per_replica=dpr, layout=layout)
            state = strategy.put_replicated(dt.TrainState.create(params=params, tx=tx))
            dist = strategy.distribute_batch(batch)
            peak = strategy.memory_analysis(train_step, args=(state, dist), donate_argnums=0)
            peak = peak["peak_bytes"]
            state_bytes = strategy.memory_report(state)["bytes_per_device"]
            shardings = strategy.state_shardings(state)
            # The global batch as the strategy placed it (rows over the replicas and a
            # replica's devices).
            placed = jax.tree.map(jnp.copy, dist.value)
            floor = jax.jit(
                floor_step,
                in_shardings=(shardings, None),
                out_shardings=(shardings, None),
                donate_argnums=0,
            )
            floor_state = jax.tree.map(jnp.copy, state)
            # The mesh in context while tracing, so activation constraints apply as in run.
            with jax.sharding.use_abstract_mesh(strategy.mesh.abstract_mesh):
                floor = floor.lower(floor_state, placed).compile()
            floor_peak = floor.memory_analysis()
            floor_peak = (
                floor_peak.argument_size_in_bytes
                + floor_peak.output_size_in_bytes
                + floor_peak.temp_size_in_bytes
                - floor_peak.alias_size_in_bytes
            )

            def distrain_loop(n: int, state: Any = state, strategy: Any = strategy, b: Any = dist):
                for _ in range(n):
                    state, loss = strategy.run(train_step, args=(state, b), donate_argnums=(0,))
                jax.block_until_ready(loss)
                return state

            def floor_loop(n: int, state: Any = floor_state, step: Any = floor, b: Any = placed):
                for _ in range(n):
                    state, loss = step(state, b)
                jax.block_until_ready(loss)
                return state

            runs[key] = {
                "replicas": strategy.num_replicas_in_sync,
                "state_bytes_per_device": state_bytes,
                "peak_bytes": int(peak),
                "floor_peak_bytes": int(floor_peak),
                "loops": (distrain_loop, floor_loop),
            }
        # Interleaved rounds: each configuration's loops keep their own state.
        states = {key: [None, None] for key in runs}
        times: dict[str, list[list[float]]] = {key: [[], []] for key in runs}
        for r in range(args.rounds + 1):
            for key, run in runs.items():
                for i, loop in enumerate(run["loops"]):
                    kwargs = {} if states[key][i] is None else {"state": states[key][i]}
                    t0 = time.perf_counter()
                    states[key][i] = loop(args.steps if r else 2, **kwargs)
                    if r:  # round 0 compiles and warms up
                        times[key][i].append(args.steps / (time.perf_counter() - t0))
        base = runs["k=1"]
        table = {}
        for key, run in runs.items():
            sps, floor_sps = (statistics.median(t) for t in times[key])
            table[key] = {
                "replicas": run["replicas"],
                "state_bytes_per_device": run["state_bytes_per_device"],
                "state_vs_mirrored": run["state_bytes_per_device"] / base["state_bytes_per_device"],
                "peak_bytes": run["peak_bytes"],
                "peak_vs_mirrored": run["peak_bytes"] / base["peak_bytes"],
                "floor_peak_bytes": run["floor_peak_bytes"],
                "steps_per_s": sps,
                "floor_steps_per_s": floor_sps,
                "vs_floor": sps / floor_sps,
            }
        results[name] = {"global_batch": global_batch, "configs": table}
        n_dev = jax.device_count()
        print(f"\n{name} (global batch {global_batch}, {n_dev} devices, jax {jax.__version__})")
        heads = ("repl", "state/dev", "x mirr", "peak/dev", "x mirr", "floor peak", "steps/s")
        print(f"{'config':8} " + " ".join(f"{h:>10}" for h in heads) + "   floor  x floor")
        for key, row in table.items():
            print(
                f"{key:8} {row['replicas']:>4} {row['state_bytes_per_device'] / 2**20:>8.2f}Mi "
                f"{row['state_vs_mirrored']:>7.3f} {row['peak_bytes'] / 2**20:>8.2f}Mi "
                f"{row['peak_vs_mirrored']:>7.3f} {row['floor_peak_bytes'] / 2**20:>8.2f}Mi "
                f"{row['steps_per_s']:>8.1f} {row['floor_steps_per_s']:>8.1f} "
                f"{row['vs_floor']:>7.3f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
