"""XLA:CPU kernel choices behind the CNN numbers: the max-pool form and YNNPACK fusions.

Times one compiled training-step gradient (``jit(grad(mean loss))``, one device) of
the benchmark models in a fresh process per ``XLA_FLAGS`` setting (flags are read
when JAX starts):

* ``mlp``: the MNIST MLP, for reference;
* ``cnn``: the benchmark CNN, max-pool as the maximum of four strided slices;
* ``cnn_reduce_window``: the same CNN with ``lax.reduce_window`` max-pooling (what
  ``nnx.max_pool`` and Keras' ``MaxPooling2D`` on JAX lower to); its gradient is a
  ``select_and_scatter``.

Both pool forms give the same values and parameter gradients
(``tests/test_config.py``); only the kernels XLA picks differ.

Usage:
  python -m benchmarks.xla_cpu [--quick] [--json F]

Prints a table of milliseconds per gradient step (median of repeats) and one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# (label, XLA_FLAGS): stock XLA, and what the benchmark's JAX workers use.
SETTINGS = (
    ("stock XLA", ""),
    ("YNN fusions off", "--xla_cpu_experimental_ynn_fusion_type="),
)
MODELS = ("mlp", "cnn", "cnn_reduce_window")


def reduce_window_pool(h: Any) -> Any:
    """2x2/2 VALID max-pool as ``lax.reduce_window`` (what ``nnx.max_pool`` lowers to)."""
    import jax
    import jax.numpy as jnp

    return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def child(repeats: int) -> dict[str, float]:
    """In the process whose ``XLA_FLAGS`` are set: ms per gradient step of each model."""
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks import workloads as wl

    out = {}
    for name in MODELS:
        w = wl.WORKLOADS[name.split("_")[0]]
        if name == "cnn_reduce_window":
            w = dataclasses.replace(
                w, apply=functools.partial(wl.cnn_apply, pool=reduce_window_pool)
            )
        data = wl.synthetic_data(w.global_batch_size)
        x, y = jnp.asarray(data["x"]), jnp.asarray(data["y"])
        params = w.init(jax.random.key(0))
        grad = jax.jit(jax.grad(lambda p, x, y, w=w: w.per_example_loss(p, x, y).mean()))
        jax.block_until_ready(grad(params, x, y))
        calls = 10 if name == "mlp" else 2  # about 20-100 ms per timing
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(grad(params, x, y))
            times.append((time.perf_counter() - t0) / calls * 1e3)
        out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 9")
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    if args.child:
        print(json.dumps(child(repeats)))
        return 0

    results = {}
    for label, flags in SETTINGS:
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "benchmarks.xla_cpu", "--child", "--repeats", str(repeats)]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{label} ({flags!r}) failed:\n{proc.stderr[-2000:]}")
        results[label] = {
            "xla_flags": flags,
            "ms": json.loads(proc.stdout.strip().splitlines()[-1]),
        }

    print(f"ms per gradient step, 1 device, median of {repeats}")
    print(f"{'model':<20}" + "".join(f"{label:>18}" for label, _ in SETTINGS))
    for name in MODELS:
        print(
            f"{name:<20}" + "".join(f"{results[label]['ms'][name]:>18.1f}" for label, _ in SETTINGS)
        )
    summary = {"benchmark": "xla_cpu", "repeats": repeats, "results": results}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
