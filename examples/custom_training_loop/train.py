"""The TensorFlow guide's custom training loop, line for line, in distrain.

TensorFlow ("Use tf.distribute.Strategy with custom training loops", seeds/002)::

    with mirrored_strategy.scope():
        model = tf.keras.Sequential([...]); optimizer = tf.keras.optimizers.SGD()
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(dist_inputs):
        per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
        return mirrored_strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    for dist_inputs in dist_dataset:
        print(distributed_train_step(dist_inputs))

distrain: the same calls; the state is an explicit value (``TrainState``) that the
step takes and returns, and ``strategy.run`` compiles the step (no ``tf.function``).
Data: scikit-learn's bundled 8x8 digits, so it runs offline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import distrain as dt
from distrain.data import ArrayPipeline, load_digits


class Model(nnx.Module):
    """A small MLP on flattened 8x8 images."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1))))


def make_steps(graphdef: Any, global_batch_size: int) -> tuple[Callable, Callable]:
    """The per-replica train and test steps (closures over the model's graph)."""

    def train_step(state: dt.TrainState, inputs: dict) -> tuple[dt.TrainState, jax.Array]:
        def loss_fn(params):
            predictions = nnx.merge(graphdef, params)(inputs["image"])
            per_example_loss = optax.softmax_cross_entropy_with_integer_labels(
                predictions, inputs["label"]
            )
            return dt.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)

        loss, gradients = jax.value_and_grad(loss_fn)(state.params)
        # Inside strategy.run, apply_gradients sums the gradients over replicas first.
        return state.apply_gradients(grads=gradients), loss

    def test_step(state: dt.TrainState, inputs: dict) -> tuple[jax.Array, jax.Array]:
        predictions = nnx.merge(graphdef, state.params)(inputs["image"])
        correct = (jnp.argmax(predictions, -1) == inputs["label"]) * inputs["mask"]
        return jnp.sum(correct), jnp.sum(inputs["mask"])  # per replica; reduced with SUM

    return train_step, test_step


def run(
    *,
    epochs: int = 10,
    global_batch_size: int = 64,
    max_steps_per_epoch: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains on all local devices; returns the losses per epoch and the test accuracy."""
    mirrored_strategy = dt.MirroredStrategy()
    log(f"Number of devices: {mirrored_strategy.num_replicas_in_sync}")

    with mirrored_strategy.scope():
        graphdef, params = nnx.split(Model(rngs=nnx.Rngs(0)))
        state = mirrored_strategy.put_replicated(
            dt.TrainState.create(params=nnx.to_pure_dict(params), tx=optax.sgd(0.05, momentum=0.9))
        )

    # num_epochs passes, reshuffled every epoch; an explicit iterator runs a given number
    # of steps per epoch (the guide's "iterator" variant). Its get_state() is the exact
    # input position, for checkpoints.
    train = ArrayPipeline(
        load_digits("train"), global_batch_size=global_batch_size, seed=0, num_epochs=epochs
    )
    test = ArrayPipeline(
        load_digits("test"),
        global_batch_size=global_batch_size,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key="mask",
    )
    train_step, test_step = make_steps(graphdef, global_batch_size)
    steps_per_epoch = min(train.steps_per_epoch, max_steps_per_epoch or train.steps_per_epoch)

    train_iterator = iter(mirrored_strategy.experimental_distribute_dataset(train))
    losses = []
    start = time.perf_counter()
    for epoch in range(epochs):
        total_loss = 0.0
        for _ in range(steps_per_epoch):
            state, per_replica_losses = mirrored_strategy.run(
                train_step, args=(state, next(train_iterator))
            )
            # A device scalar: adding it does not wait for the step to finish.
            total_loss += mirrored_strategy.reduce(dt.ReduceOp.SUM, per_replica_losses, axis=None)
        losses.append(float(total_loss) / steps_per_epoch)  # float(): one sync per epoch
        log(f"epoch {epoch + 1}: loss {losses[-1]:.4f}")

    # Test accuracy: a for loop over the distributed dataset; the last batch is padded
    # and masked, so each test image counts exactly once.
    correct = count = 0.0
    for dist_inputs in mirrored_strategy.experimental_distribute_dataset(test):
        per_replica_correct, per_replica_count = mirrored_strategy.run(
            test_step, args=(state, dist_inputs)
        )
        correct += float(mirrored_strategy.reduce("sum", per_replica_correct, axis=None))
        count += float(mirrored_strategy.reduce("sum", per_replica_count, axis=None))
    accuracy = correct / count
    seconds = time.perf_counter() - start
    log(f"test accuracy {accuracy:.4f} on {int(count)} images ({seconds:.1f} s)")
    return {
        "losses": losses,
        "test_accuracy": accuracy,
        "test_count": int(count),
        "seconds": seconds,
        "state": state,
    }
