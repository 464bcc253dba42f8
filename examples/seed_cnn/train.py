"""The CNN of seed ``000`` under ``MirroredStrategy``, as a distrain custom loop.

The seed (a Keras ``Sequential`` built inside ``MirroredStrategy().scope()``) is::

    Conv2D(32, 3x3, relu) -> MaxPooling2D(2) -> Conv2D(64, 3x3, relu) -> Flatten
    -> Dense(64, relu) -> Dense(10)          # Adam, sparse categorical cross-entropy

Here the same network is a flax NNX module and training is the ``tf.distribute``
custom loop: ``experimental_distribute_dataset`` splits each global batch over the
replicas, ``strategy.run`` runs the per-replica step, ``dt.compute_average_loss``
divides by the *global* batch size, ``TrainState.apply_gradients`` sums gradients
over replicas and ``strategy.reduce`` brings the loss back.

Two departures from the seed, both deliberate:

* The seed's last layer is ``Dense(10, activation="softmax")`` while its loss says
  ``from_logits=True`` (softmax applied twice); this model returns logits.
* On the offline 8x8 digits the convolutions use ``SAME`` padding (8 -> pool -> 4x4),
  since ``VALID`` 3x3 convolutions would shrink 8x8 inputs to almost nothing. On 28x28
  MNIST (``dataset="mnist"``) the seed's ``VALID`` padding is kept.

Example:
  >>> import distrain as dt
  >>> result = train(Config(epochs=1), dt.MirroredStrategy())  # doctest: +SKIP
  >>> result.test_accuracy  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import distrain as dt
from distrain.data import ArrayPipeline
from examples.common import DATASETS, evaluate_classifier, load_data


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters (defaults: the run in README.md)."""

    dataset: str = "digits"
    """``digits`` (scikit-learn's 8x8 digits, offline) or ``mnist`` (downloads once)."""
    epochs: int = 20
    global_batch_size: int = 64
    """Summed over replicas; each of N replicas gets ``global_batch_size // N`` rows."""
    learning_rate: float = 1e-3
    seed: int = 0
    max_steps: int | None = None
    """Stop after this many steps (smoke tests); None runs every epoch."""

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}; received {self.dataset!r}.")
        for name in ("epochs", "global_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; received {name}={value!r}.")


class CNN(nnx.Module):
    """The seed's CNN; ``image_size`` picks the padding (see the module docstring)."""

    def __init__(self, image_size: int, *, rngs: nnx.Rngs, num_classes: int = 10) -> None:
        self.padding = "VALID" if image_size >= 16 else "SAME"
        shrink = 2 if self.padding == "VALID" else 0  # a VALID 3x3 conv loses 2 pixels
        side = (image_size - shrink) // 2 - shrink
        self.conv1 = nnx.Conv(1, 32, (3, 3), padding=self.padding, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), padding=self.padding, rngs=rngs)
        self.dense1 = nnx.Linear(side * side * 64, 64, rngs=rngs)
        self.dense2 = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv1(x))
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        x = nnx.relu(self.conv2(x))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dense1(x))
        return self.dense2(x)


@dataclasses.dataclass
class Result:
    """What :func:`train` returns."""

    test_accuracy: float
    history: list[dict[str, float]]
    """One record per epoch: ``epoch``, ``train_loss``, ``test_accuracy``, ``seconds``."""
    steps: int
    seconds: float
    num_replicas: int
    state: Any


def train_step(graphdef: nnx.GraphDef, state: dt.TrainState, batch: dict[str, jax.Array]):
    """One step on one replica's slice of the global batch."""

    def loss_fn(params: Any) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch["image"])
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return dt.compute_average_loss(per_example)  # / global batch: the sum is the mean

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def train(config: Config, strategy: dt.Strategy, *, log: Callable[[str], None] = print) -> Result:
    """Trains the CNN with ``strategy``; evaluates on the test split after every epoch."""
    train_data, test_data = load_data(config.dataset)
    image_size = train_data["image"].shape[1]
    with strategy.scope():
        graphdef, params = nnx.split(CNN(image_size, rngs=nnx.Rngs(config.seed)))
        state = dt.TrainState.create(
            params=nnx.to_pure_dict(params), tx=optax.adam(config.learning_rate)
        )
        state = strategy.put_replicated(state)

    pipe = ArrayPipeline(
        train_data,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        num_epochs=config.epochs,
    )
    batches = iter(strategy.experimental_distribute_dataset(pipe))
    log(
        f"{strategy.num_replicas_in_sync} replicas, global batch {config.global_batch_size}, "
        f"{pipe.steps_per_epoch} steps per epoch, {config.epochs} epochs on {config.dataset}"
    )
    history: list[dict[str, float]] = []
    steps, start = 0, time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        losses = []
        for _ in range(pipe.steps_per_epoch):
            if config.max_steps is not None and steps >= config.max_steps:
                break
            state, loss = strategy.run(train_step, args=(graphdef, state, next(batches)))
            # Stays on the device: converting here would sync the host every step.
            losses.append(strategy.reduce("sum", loss))
            steps += 1
        if not losses:
            break
        accuracy = evaluate_classifier(
            strategy, graphdef, state.params, test_data, config.global_batch_size
        )
        record = {
            "epoch": epoch,
            "train_loss": float(jnp.mean(jnp.stack(losses))),
            "test_accuracy": accuracy,
            "seconds": time.perf_counter() - start,
        }
        history.append(record)
        log(
            f"epoch {epoch:3d}  train loss {record['train_loss']:.4f}  "
            f"test accuracy {accuracy:.4f}  {record['seconds']:.1f} s"
        )
    seconds = time.perf_counter() - start
    return Result(
        test_accuracy=history[-1]["test_accuracy"] if history else float("nan"),
        history=history,
        steps=steps,
        seconds=seconds,
        num_replicas=strategy.num_replicas_in_sync,
        state=state,
    )


def plot_history(history: list[dict[str, float]], path: str, title: str) -> None:
    """Writes a two-panel PNG: training loss and test accuracy per epoch."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3), dpi=80)
    ax1.plot(epochs, [r["train_loss"] for r in history], marker=".")
    ax1.set(xlabel="epoch", ylabel="train loss (cross-entropy)", yscale="log")
    ax2.plot(epochs, [r["test_accuracy"] for r in history], marker=".", color="tab:green")
    ax2.set(xlabel="epoch", ylabel="test accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
