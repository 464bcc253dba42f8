"""Evaluation inside ``fit`` against a sidecar evaluator: what the training pays.

The same training (an MLP classifier on synthetic data, 8 virtual CPU devices,
``dt.MirroredStrategy``, a checkpoint every ``--every`` steps in both arms) runs twice:
``in_fit`` validates every ``--every`` steps inside ``fit`` (``validation_data``),
stopping the training for each evaluation; ``sidecar`` does not, while a
``dt.SidecarEvaluator`` in another process (one device) evaluates each one
(``every_checkpoint=True``) and stops after the training's final checkpoint. Recorded per
arm from the training's goodput ledger: its ``evaluation`` bucket and its wall time; for
the sidecar also each checkpoint's ``lag_s`` (written to result recorded) and the
evaluator's own ``evaluation`` bucket. Both processes share the machine's cores: on a
2-core machine the sidecar's evaluation competes with the training for them.

Usage:
  python -m benchmarks.sidecar                     # writes benchmarks/results/sidecar.json
  python -m benchmarks.sidecar --steps 20 --every 10 --eval-rows 512 --json /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _setup(args: argparse.Namespace, devices: int) -> tuple:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import distrain as dt

    rng = np.random.default_rng(0)
    d, h = 64, args.hidden
    teacher = rng.normal(size=(d, 10)).astype(np.float32)

    def arrays(n: int) -> dict:
        x = rng.normal(size=(n, d)).astype(np.float32)
        return {"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)}

    train = dt.data.ArrayPipeline(arrays(8192), global_batch_size=256, num_epochs=None, seed=0)
    test = dt.data.ArrayPipeline(
        arrays(args.eval_rows), global_batch_size=1024, num_epochs=1, shuffle=False,
        drop_remainder=False, mask_key="mask",
    )  # fmt: skip

    def logits(p: dict, x: jax.Array) -> jax.Array:
        z = jnp.tanh(x @ p["w1"])
        z = jnp.tanh(z @ p["w2"])
        return z @ p["w3"]

    def train_step(state, batch):
        def loss(p):
            per_row = optax.softmax_cross_entropy_with_integer_labels(
                logits(p, batch["x"]), batch["y"]
            )
            return dt.compute_average_loss(per_row)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    def eval_step(state, batch):
        out = logits(state.params, batch["x"])
        per_row = optax.softmax_cross_entropy_with_integer_labels(out, batch["y"])
        right = (jnp.argmax(out, -1) == batch["y"]).astype(jnp.float32)
        return {
            "loss": dt.metrics.Mean.from_values(per_row, mask=batch["mask"]),
            "accuracy": dt.metrics.Mean.from_values(right, mask=batch["mask"]),
        }

    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (d, h)) / np.sqrt(d),
        "w2": jax.random.normal(k[1], (h, h)) / np.sqrt(h),
        "w3": jax.random.normal(k[2], (h, 10)) / np.sqrt(h),
    }
    state = dt.TrainState.create(params=params, tx=optax.adam(1e-3))
    return dt, train, test, train_step, eval_step, state


def follow(args: argparse.Namespace) -> int:
    """The sidecar process: one device, every checkpoint of ``args.follow``."""
    dt, _, test, _, eval_step, state = _setup(args, 1)
    sidecar = dt.SidecarEvaluator(
        eval_step, test, args.follow, state=state, every_checkpoint=True,
        poll_interval=0.1, timeout=300, workdir=args.workdir,
    )  # fmt: skip
    sidecar.start()
    with open(os.path.join(args.workdir, "lags.json"), "w") as f:
        json.dump([r["lag_s"] for r in sidecar.results], f)
    return 0


def _train(args: argparse.Namespace, arm: str, workdir: str) -> dict:
    dt, train, test, train_step, eval_step, state = _setup(args, 8)
    # Both arms write the same checkpoints: they differ in where evaluation runs only.
    ckpt = os.path.join(workdir, "ckpt")
    callbacks = [
        dt.callbacks.Goodput(workdir),
        dt.callbacks.ModelCheckpoint(ckpt, save_freq=args.every, max_to_keep=None),
    ]
    fit_kwargs: dict = {"steps_per_epoch": args.every, "epochs": args.steps // args.every}
    if arm == "in_fit":
        fit_kwargs["validation_data"] = test
    trainer = dt.Trainer(dt.MirroredStrategy(), train_step, eval_step, callbacks=callbacks)
    side = None
    if arm == "sidecar":
        cmd = [sys.executable, "-m", "benchmarks.sidecar", "--follow", ckpt,
               "--workdir", os.path.join(workdir, "sidecar"), "--hidden", str(args.hidden),
               "--eval-rows", str(args.eval_rows)]  # fmt: skip
        env = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": ROOT}
        side = subprocess.Popen(cmd, cwd=ROOT, env=env)
    t0 = time.perf_counter()
    trainer.fit(state, train, **fit_kwargs)
    fit_s = time.perf_counter() - t0
    row: dict = {"arm": arm, "fit_s": round(fit_s, 3)}
    report = dt.goodput.report(workdir)
    row["trainer_evaluation_s"] = round(report.buckets_s.get("evaluation", 0.0), 3)
    row["trainer_wall_s"] = round(report.wall_s, 3)
    if side is not None:
        if side.wait(timeout=600):
            raise RuntimeError(f"the sidecar exited {side.returncode}")
        side_dir = os.path.join(workdir, "sidecar")
        with open(os.path.join(side_dir, "lags.json")) as f:
            row["lag_s"] = [round(x, 3) for x in json.load(f)]
        row["sidecar_evaluation_s"] = round(
            dt.goodput.report(side_dir).buckets_s.get("evaluation", 0.0), 3
        )
        row["evaluations"] = len(row["lag_s"])
    else:
        row["evaluations"] = args.steps // args.every
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--eval-rows", type=int, default=65536)
    p.add_argument("--json", default=os.path.join(HERE, "results", "sidecar.json"))
    p.add_argument("--follow", help=argparse.SUPPRESS)  # the sidecar process
    p.add_argument("--arm", help=argparse.SUPPRESS)  # one arm's training process
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.follow:
        return follow(args)
    if args.arm:
        with open(args.json, "w") as f:
            json.dump(_train(args, args.arm, args.workdir), f)
        return 0
    rows = []
    for arm in ("in_fit", "sidecar"):
        # Each arm in a fresh process: the same start-up and compile caches for both.
        out = tempfile.mktemp(suffix=".json")
        workdir = tempfile.mkdtemp(prefix=f"sidecar-{arm}-")
        cmd = [sys.executable, "-m", "benchmarks.sidecar", "--arm", arm, "--workdir", workdir,
               "--json", out, "--steps", str(args.steps), "--every", str(args.every),
               "--hidden", str(args.hidden), "--eval-rows", str(args.eval_rows)]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT})
        with open(out) as f:
            rows.append(json.load(f))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": "python -m benchmarks.sidecar" + (" " + " ".join(argv) if argv else ""),
        "setting": f"MLP 64-{args.hidden}-{args.hidden}-10, 8 virtual CPU devices, "
        f"{args.steps} steps, an evaluation of {args.eval_rows} rows every {args.every} steps",
        "rows": rows,
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],  # a shared machine
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
