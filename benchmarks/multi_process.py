"""Cost of crossing processes: 2 processes x 1 device against 1 process x 2 devices.

Both configurations train the MNIST MLP (784-256-256-10, Adam, global batch 512)
with ``MultiWorkerMirroredStrategy`` and the same ``train_step``; each replica sees
256 rows per step. The only difference is where the gradient all-reduce goes:
inside one process (XLA's in-process collectives) or between two processes
(gloo over TCP on 127.0.0.1, started by ``distrain launch``). Batches come from
``experimental_distribute_dataset`` over host NumPy batches, as in training.

Usage:
  python -m benchmarks.multi_process [--steps 200] [--warmup 20] [--repeats 3] [--json F]

Prints a table and one JSON object (steps/s of each configuration, and the ratio
two-process / one-process; 1.0 means crossing processes costs nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> int:
    """One process of one configuration: times `--steps` steps, `--repeats` times."""
    from distrain import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()  # before any other JAX call

    import itertools

    import jax
    import optax

    import distrain as dt
    from benchmarks.workloads import WORKLOADS, host_batches

    w = WORKLOADS["mlp"]
    batches = host_batches(w, 8)

    def train_step(state, batch):
        def loss_fn(params):
            per_example = w.per_example_loss(params, batch["x"], batch["y"])
            return dt.compute_average_loss(per_example, global_batch_size=w.global_batch_size)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    with strategy.scope():
        state = strategy.put_replicated(
            dt.TrainState.create(params=w.init(jax.random.key(0)), tx=optax.adam(1e-3))
        )
        data = iter(strategy.experimental_distribute_dataset(itertools.cycle(batches)))
        for _ in range(args.warmup):
            state, _ = strategy.run(train_step, args=(state, next(data)))
        jax.block_until_ready(state)
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.steps):
                state, loss = strategy.run(train_step, args=(state, next(data)))
            jax.block_until_ready(state)
            rates.append(args.steps / (time.perf_counter() - start))
    if strategy.is_chief:
        result = {
            "processes": jax.process_count(),
            "devices_per_process": len(jax.local_devices()),
            "replicas": strategy.num_replicas_in_sync,
            "steps_per_s": rates,
        }
        Path(args.worker_out).write_text(json.dumps(result))
    return 0


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout.decode(errors='replace')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps (compilation)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats; best is kept")
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        return worker(args)

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env.pop("TF_CONFIG", None)
    env["JAX_PLATFORMS"] = "cpu"
    flags = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    flags += ["--repeats", str(args.repeats)]
    me = [sys.executable, "-m", "benchmarks.multi_process", *flags]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp, "one.json")
        env_one = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
        _run([*me, "--worker-out", str(one)], env_one, args.timeout)
        results["1 process x 2 devices"] = json.loads(one.read_text())
        two = Path(tmp, "two.json")
        launch = [sys.executable, "-m", "distrain._src.cluster.launch", "--nproc", "2"]
        launch += ["--devices-per-proc", "1", "--timeout", "60", "--"]
        _run([*launch, *me, "--worker-out", str(two)], env, args.timeout)
        results["2 processes x 1 device"] = json.loads(two.read_text())

    best = {name: max(r["steps_per_s"]) for name, r in results.items()}
    ratio = best["2 processes x 1 device"] / best["1 process x 2 devices"]
    print(f"MNIST MLP, global batch 512, {args.steps} steps x {args.repeats} repeats (best)")
    print(f"{'configuration':<26}{'replicas':>9}{'steps/s':>10}")
    for name, r in results.items():
        print(f"{name:<26}{r['replicas']:>9}{best[name]:>10.1f}")
    print(f"{'ratio 2-proc / 1-proc':<26}{'':>9}{ratio:>10.2f}")
    summary = {
        "benchmark": "multi_process",
        "workload": "mlp",
        "global_batch_size": 512,
        "steps": args.steps,
        "repeats": args.repeats,
        "results": {name: {**r, "best_steps_per_s": best[name]} for name, r in results.items()},
        "ratio_two_process_over_one_process": ratio,
    }
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
