"""Sharded vs replicated state, bfloat16 vs float32: steps/s and state bytes per device.

Two workloads on whatever devices are present (8 virtual CPU devices by default here):
the MNIST MLP (784-256-256-10, Adam, batch 512) and a pre-norm transformer block
(d=256, 4 heads, MLP 1024, sequence 128, batch 32, Adam). For each, four
configurations train with ``strategy.run`` in interleaved rounds: MirroredStrategy
and ``shard_state=True``, each in float32 and ``mixed_bfloat16``. Reported: median
steps/s, the ratio to mirrored float32, and ``strategy.memory_report`` of the state.

Example::

    python -m benchmarks.scaling                 # 8 virtual CPU devices
    python -m benchmarks.scaling --devices 1 --json /tmp/scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def mlp(jax: Any, jnp: Any, rng: Any) -> tuple[Any, Any, Any]:
    sizes = [784, 256, 256, 10]
    keys = jax.random.split(rng, len(sizes))
    params = {
        f"w{i}": jax.random.normal(keys[i], (a, b)) * (1 / a) ** 0.5
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }
    params.update({f"b{i}": jnp.zeros(b) for i, b in enumerate(sizes[1:])})

    def logits(p: Any, x: Any) -> Any:
        for i in range(3):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            x = jax.nn.relu(x) if i < 2 else x
        return x.astype(jnp.float32)

    def batch(n: int) -> dict:
        import numpy as np

        r = np.random.default_rng(0)
        return {"x": r.normal(size=(n, 784)).astype(np.float32), "y": r.integers(0, 10, n)}

    return params, logits, batch


def block(jax: Any, jnp: Any, rng: Any, d: int = 256, heads: int = 4, seq: int = 128):
    k = jax.random.split(rng, 4)
    s = d**-0.5
    params = {
        "qkv": jax.random.normal(k[0], (d, 3 * d)) * s,
        "proj": jax.random.normal(k[1], (d, d)) * s,
        "up": jax.random.normal(k[2], (d, 4 * d)) * s,
        "down": jax.random.normal(k[3], (4 * d, d)) * (4 * d) ** -0.5,
        "ln1": jnp.ones(d),
        "ln2": jnp.ones(d),
        "head": jnp.zeros((d, 10)),
    }

    def norm(x: Any, g: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def logits(p: Any, x: Any) -> Any:
        b, t, _ = x.shape
        q, kk, v = jnp.split(norm(x, p["ln1"]) @ p["qkv"], 3, -1)
        shape = (b, t, heads, d // heads)
        att = jax.nn.dot_product_attention(
            q.reshape(shape), kk.reshape(shape), v.reshape(shape), is_causal=True
        )
        x = x + att.reshape(b, t, d) @ p["proj"]
        x = x + jax.nn.gelu(norm(x, p["ln2"]) @ p["up"]) @ p["down"]
        return (jnp.mean(x, 1) @ p["head"]).astype(jnp.float32)

    def batch(n: int) -> dict:
        import numpy as np

        r = np.random.default_rng(0)
        return {
            "x": r.normal(size=(n, seq, d)).astype(np.float32),
            "y": r.integers(0, 10, n),
        }

    return params, logits, batch


WORKLOADS = {"mlp": (mlp, 512), "transformer_block": (block, 32)}
CONFIGS = {
    "mirrored_f32": (False, None),
    "sharded_f32": (True, None),
    "mirrored_bf16": (False, "mixed_bfloat16"),
    "sharded_bf16": (True, "mixed_bfloat16"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma list of: " + ",".join(WORKLOADS)
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 3, 2
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax
    import jax.numpy as jnp
    import optax

    import distrain as dt

    devices = jax.devices()[: args.devices]
    results: dict[str, Any] = {"devices": len(devices), "backend": jax.default_backend()}
    for wname in args.workloads.split(","):
        if wname not in WORKLOADS:
            parser.error(f"unknown workload {wname!r}; expected some of {list(WORKLOADS)}")
        make, global_batch = WORKLOADS[wname]
        params, logits_fn, make_batch = make(jax, jnp, jax.random.key(0))
        host_batch = make_batch(global_batch)

        def step(state: Any, batch: Any, logits_fn: Any = logits_fn) -> Any:
            def loss_fn(p: Any, b: Any) -> Any:
                per = optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, b["x"]), b["y"])
                return dt.compute_average_loss(per)

            loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads=grads), loss

        runs: dict[str, Any] = {}
        for cname, (shard, policy) in CONFIGS.items():
            strategy = dt.MirroredStrategy(devices, shard_state=shard)
            fresh = jax.tree.map(jnp.copy, params)  # each run donates its own buffers
            state = strategy.put_replicated(
                dt.TrainState.create(params=fresh, tx=optax.adam(1e-3), policy=policy)
            )
            batch = strategy.distribute_batch(host_batch)
            for _ in range(2):  # compile and warm up
                state, loss = strategy.run(step, args=(state, batch), donate_argnums=(0,))
            jax.block_until_ready(state)
            runs[cname] = {"strategy": strategy, "state": state, "batch": batch, "times": []}
        for r in range(args.rounds):
            names = list(runs)
            for cname in names[r % len(names) :] + names[: r % len(names)]:
                run = runs[cname]
                t = time.perf_counter()
                state = run["state"]
                for _ in range(args.steps):
                    state, _ = run["strategy"].run(
                        step, args=(state, run["batch"]), donate_argnums=(0,)
                    )
                jax.block_until_ready(state)
                run["times"].append(time.perf_counter() - t)
                run["state"] = state
        base = None
        table = {}
        for cname, run in runs.items():
            sps = args.steps / statistics.median(run["times"])
            base = base or sps
            report = run["strategy"].memory_report(run["state"])
            table[cname] = {"steps_per_sec": sps, "vs_mirrored_f32": sps / base, **report}
            print(
                f"{wname:18s} {cname:14s} {sps:8.1f} steps/s  x{sps / base:5.2f}  "
                f"state {report['bytes_per_device'] / 2**20:7.2f} MiB/device "
                f"(full copy {report['bytes_full_copy'] / 2**20:.2f} MiB)",
                flush=True,
            )
        results[wname] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
