"""A linear-regression problem shared by the Trainer and callback tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import distrain as dt
from distrain.metrics import Mean

DIM = 4


def problem(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x @ np.arange(1, DIM + 1, dtype=np.float32) + 0.5).astype(np.float32)
    return {"x": x, "y": y}


def apply_fn(params, x):
    return x @ params["w"] + params["b"]


def train_step(state, batch):
    def loss_fn(p):
        err = (apply_fn(p, batch["x"]) - batch["y"]) ** 2
        return dt.compute_average_loss(err), err

    grads, err = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss": Mean.from_values(err)}


def eval_step(state, batch):
    err = (apply_fn(state.params, batch["x"]) - batch["y"]) ** 2
    return {"loss": Mean.from_values(err, mask=batch.get("mask"))}


def new_state(lr=0.05):
    params = {"w": jnp.zeros((DIM,)), "b": jnp.zeros(())}
    return dt.TrainState.create(params=params, tx=optax.sgd(lr))
