"""Seed ``003``'s speed test: the same model trained normally and with ``MirroredStrategy``.

The seed notebook builds ``Dense(128, relu) -> Dropout(0.2) -> Dense(10)`` twice, once
plainly and once inside ``MirroredStrategy().scope()``, fits both on MNIST for 10
epochs and prints how long each took. Here:

* :func:`run_normal` is plain JAX: one device, one ``jax.jit`` step, the mean loss;
* :func:`run_distributed` is the distrain custom loop: ``experimental_distribute_dataset``,
  ``strategy.run``, ``dt.compute_average_loss``, ``TrainState.apply_gradients``
  (gradients summed over replicas) and ``strategy.reduce``.

Both see the same global batches in the same order, so they do the same work per
step; each replica gets ``global_batch_size / N`` rows and its own dropout mask
(the step key folded with the replica id).

Two bugs of the seed are not copied: it divides the *labels* by 255
(``y_train = y_train / 255.0``) and its model ends in a softmax; labels stay
integers and the model returns logits.

Example:
  >>> normal = run_normal(Config(epochs=1))  # doctest: +SKIP
  >>> dist = run_distributed(Config(epochs=1), dt.MirroredStrategy())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import distrain as dt
from distrain.data import ArrayPipeline
from examples.common import DATASETS, load_data


@dataclasses.dataclass(frozen=True)
class Config:
    """The run (defaults: the numbers in README.md)."""

    dataset: str = "digits"
    epochs: int = 40
    global_batch_size: int = 200
    """The seed's batch of 25, per replica, times 8 replicas (both runs use it)."""
    learning_rate: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}; received {self.dataset!r}.")
        for name in ("epochs", "global_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; received {name}={value!r}.")


class Model(nnx.Module):
    """``Dense(128, relu) -> Dropout(0.2) -> Dense(10)`` on flattened images."""

    def __init__(self, in_features: int, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(in_features, 128, rngs=rngs)
        self.dropout = nnx.Dropout(0.2)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        x = nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))
        x = self.dropout(x, deterministic=dropout_key is None, rngs=dropout_key)
        return self.out(x)


@dataclasses.dataclass
class Timing:
    """One run's measurements (JSON-friendly)."""

    mode: str
    platform: str
    """``cpu``, ``gpu`` or ``tpu``."""
    num_devices: int
    steps: int
    total_seconds: float
    """Wall time of the whole loop, the first (compiling) step included."""
    first_step_seconds: float
    """The first step: tracing and compiling, then running."""
    steps_per_second: float
    """After the first step (steady state)."""
    final_loss: float
    test_accuracy: float


def init_state(config: Config, in_features: int) -> tuple[nnx.GraphDef, dt.TrainState]:
    graphdef, params = nnx.split(Model(in_features, rngs=nnx.Rngs(config.seed)))
    state = dt.TrainState.create(
        params=nnx.to_pure_dict(params),
        tx=optax.adam(config.learning_rate),
        rng=jax.random.key(config.seed),
    )
    return graphdef, state


def _per_example_loss(graphdef, params, batch, dropout_key) -> jax.Array:
    logits = nnx.merge(graphdef, params)(batch["image"], dropout_key=dropout_key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def _accuracy(graphdef: nnx.GraphDef, params: Any, data: dict[str, np.ndarray]) -> float:
    logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, data["image"])
    return float(jnp.mean(jnp.argmax(logits, -1) == data["label"]))


def _pipeline(config: Config, train_data: dict[str, np.ndarray]) -> ArrayPipeline:
    return ArrayPipeline(
        train_data,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        num_epochs=config.epochs,
    )


def _timed_loop(step_fn, state, batches) -> tuple[Any, list[jax.Array], float, float, int]:
    """Runs every batch; returns state, losses, first-step and total seconds, steps."""
    losses = []
    start = time.perf_counter()
    first = None
    for batch in batches:
        state, loss = step_fn(state, batch)
        losses.append(loss)
        if first is None:
            jax.block_until_ready(loss)
            first = time.perf_counter() - start
    jax.block_until_ready((state, losses))
    return state, losses, first or 0.0, time.perf_counter() - start, len(losses)


def _timing(mode, n, steps, total, first, losses, accuracy) -> Timing:
    return Timing(
        mode=mode,
        platform=jax.devices()[0].platform,
        num_devices=n,
        steps=steps,
        total_seconds=total,
        first_step_seconds=first,
        steps_per_second=(steps - 1) / (total - first) if steps > 1 else float("nan"),
        final_loss=float(losses[-1]),
        test_accuracy=accuracy,
    )


def run_normal(config: Config, device: jax.Device | None = None) -> Timing:
    """Plain JAX on one device: ``jax.jit`` of a step that uses the batch mean."""
    device = device or jax.devices()[0]
    train_data, test_data = load_data(config.dataset)
    graphdef, state = init_state(config, int(np.prod(train_data["image"].shape[1:])))
    state = jax.device_put(state, device)

    @jax.jit
    def step(state: dt.TrainState, batch: dict[str, jax.Array]):
        rng, key = jax.random.split(state.rng)

        def loss_fn(params):
            return jnp.mean(_per_example_loss(graphdef, params, batch, key))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads, rng=rng), loss

    batches = (jax.device_put(b, device) for b in _pipeline(config, train_data))
    state, losses, first, total, steps = _timed_loop(step, state, batches)
    accuracy = _accuracy(graphdef, state.params, test_data)
    return _timing("normal", 1, steps, total, first, losses, accuracy)


def distributed_step(graphdef: nnx.GraphDef, state: dt.TrainState, batch: dict[str, jax.Array]):
    """The per-replica step for ``strategy.run``."""
    rng, key = jax.random.split(state.rng)  # same on every replica: the new rng stays replicated
    ctx = dt.get_replica_context()
    key = jax.random.fold_in(key, ctx.replica_id_in_sync_group)  # own dropout mask per replica

    def loss_fn(params):
        return dt.compute_average_loss(_per_example_loss(graphdef, params, batch, key))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads, rng=rng), loss


def run_distributed(config: Config, strategy: dt.Strategy) -> Timing:
    """The distrain custom loop over ``strategy``'s replicas."""
    train_data, test_data = load_data(config.dataset)
    with strategy.scope():
        graphdef, state = init_state(config, int(np.prod(train_data["image"].shape[1:])))
        state = strategy.put_replicated(state)
        dist = strategy.experimental_distribute_dataset(_pipeline(config, train_data))

        def step(state, batch):
            state, loss = strategy.run(distributed_step, args=(graphdef, state, batch))
            return state, strategy.reduce("sum", loss)

        state, losses, first, total, steps = _timed_loop(step, state, dist)
    accuracy = _accuracy(graphdef, state.params, test_data)
    return _timing(
        "distributed", strategy.num_replicas_in_sync, steps, total, first, losses, accuracy
    )
