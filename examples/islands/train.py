"""Fault-isolated islands: one island of a DiLoCo run (docs/islands.md).

Start every island at once, each in its own JAX world, with a local Ray cluster for
their coordinator:

    distrain launch --islands 2 --max-restarts 3 -- python examples/islands/train.py --epochs 200

Kill one island (``kill -9 PID``, a pid the launcher prints) while it runs: the other
goes on, the launcher restarts the dead one, and it rejoins from the global parameters.
Every row is trained once. The default 2 epochs train for about a second, too short
to kill by hand; 200 train for about a minute. See README.md.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import distrain as dt


def make_data(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A noisy nonlinear regression, y = tanh(x @ w1) @ w2 + noise (the teacher's
    weights are fixed; ``seed`` draws the rows)."""
    teacher = np.random.default_rng(42)
    w1, w2 = teacher.standard_normal((8, 16)) * 0.5, teacher.standard_normal((16, 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 8)).astype(np.float32)
    y = np.tanh(x @ w1) @ w2 + 0.05 * rng.standard_normal((rows, 1))
    return {"x": x, "y": y.astype(np.float32)}


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (8, 32)) * 0.3,
        "w2": jax.random.normal(k2, (32, 1)) * 0.3,
    }


def predict(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def train_step(state: dt.TrainState, batch: dict[str, jax.Array]):
    """The per-replica step, as written for MirroredStrategy."""

    def loss_fn(params):
        err = predict(params, batch["x"]) - batch["y"]
        return dt.compute_average_loss(jnp.sum(err**2, axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directory", default="runs/islands_example")
    p.add_argument(
        "--epochs", type=int, default=2, help="passes over the rows (200: a minute, to kill one)"
    )
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    args = p.parse_args()

    data = make_data(4096)
    heldout = make_data(512, seed=1)
    state = dt.TrainState.create(params=init_params(jax.random.key(0)), tx=optax.adam(1e-2))
    result = dt.experimental.islands.train(
        train_step,
        state,
        data,  # random access: the coordinator hands out rows by index
        batch_size=32,  # rows per inner step of one island
        sync_every=8,  # H: inner steps per round
        directory=args.directory,  # the coordinator's checkpoints, each island's ledger
        epochs=args.epochs,
        mode=args.mode,
        death_timeout=5.0,
    )
    err = predict(result.params, heldout["x"]) - heldout["y"]
    island = int(os.environ.get("DISTRAIN_ISLAND", "0"))
    print(
        f"island {island}: {result.rounds} rounds here, held-out MSE "
        f"{float(jnp.mean(jnp.sum(err**2, -1))):.4f} (variance of y: {heldout['y'].var():.4f})"
    )


if __name__ == "__main__":
    main()
