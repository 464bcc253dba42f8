"""Seed ``004``: MobileNetV2 trained with ``MirroredStrategy``, as a distrain custom loop.

The seed builds ``tf.keras.applications.MobileNetV2(weights=None, classes=2)`` inside
``MirroredStrategy().scope()`` and fits it on cats vs dogs (224x224, 64 images per
replica, Adam 1e-3, 5 epochs). Here the model is the flax module in ``model.py``
and one step per replica is:

1. rebuild the model from its graph definition, parameters and batch-norm averages
   (``nnx.merge``), run it in training mode on this replica's slice;
2. ``dt.compute_average_loss`` (divides by the global batch), gradients;
3. average the updated batch-norm running statistics over replicas
   (``ctx.all_reduce("mean", ...)``), so they stay identical on every replica, like
   Keras' ON_READ/MEAN moving averages under a strategy;
4. ``state.apply_gradients`` sums the gradients over replicas and updates.

Example:
  >>> result = train(Config(epochs=1), dt.MirroredStrategy())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import distrain as dt
from distrain.data import ArrayPipeline
from examples.common import masked_accuracy
from examples.mobilenet_v2 import data as data_lib
from examples.mobilenet_v2.model import MobileNetV2

DATASETS = ("stripes", "cats_vs_dogs")


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters (defaults: the run in README.md)."""

    dataset: str = "stripes"
    """``stripes`` (synthetic, offline) or ``cats_vs_dogs`` (see ``data.py``)."""
    data_dir: str | None = None
    """For ``cats_vs_dogs``: the unpacked archive; None uses tensorflow_datasets."""
    image_size: int = 32
    width_multiplier: float = 0.35
    stages: int = 7
    """Bottleneck stages built (7: the whole network; fewer only for smoke tests)."""
    sync_batch_norm: bool = False
    """Batch statistics over the global batch instead of each replica's slice."""
    num_train: int = 4096
    """Synthetic training images (``stripes`` only)."""
    num_test: int = 1024
    epochs: int = 8
    global_batch_size: int = 128
    learning_rate: float = 3e-3
    seed: int = 0
    max_steps: int | None = None
    """Stop after this many steps (smoke tests); None runs every epoch."""

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}; received {self.dataset!r}.")
        for name in ("epochs", "global_batch_size", "image_size", "num_train", "num_test"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; received {name}={value!r}.")


@dataclasses.dataclass
class Result:
    test_accuracy: float
    history: list[dict[str, float]]
    """Per epoch: ``epoch``, ``train_loss``, ``train_accuracy``, ``test_accuracy``, ``seconds``."""
    steps: int
    seconds: float
    num_replicas: int
    num_params: int
    state: Any


def load_data(config: Config) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    if config.dataset == "stripes":
        return (
            data_lib.make_stripes(config.num_train, image_size=config.image_size, seed=config.seed),
            data_lib.make_stripes(
                config.num_test, image_size=config.image_size, seed=config.seed + 1
            ),
        )
    data, skipped = data_lib.load_cats_vs_dogs(config.data_dir, image_size=config.image_size)
    if skipped:
        print(f"skipped {skipped} files that could not be decoded")
    return data_lib.split(data, test_fraction=0.1, seed=config.seed)


def _images(batch: dict[str, jax.Array]) -> jax.Array:
    return batch["image"].astype(jnp.float32) / 255.0


def train_step(graphdef: nnx.GraphDef, state: dt.TrainState, batch: dict[str, jax.Array]):
    """One step on one replica's slice (see the module docstring)."""

    def loss_fn(params: Any):
        model = nnx.merge(graphdef, params, state.extra["batch_stats"])
        logits = model(_images(batch), train=True)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"])
        return dt.compute_average_loss(per_example), (stats, correct)

    (loss, (stats, correct)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    stats = dt.get_replica_context().all_reduce("mean", stats)
    state = state.apply_gradients(grads=grads, extra={"batch_stats": stats})
    return state, {"loss": loss, "correct": correct}


def eval_step(graphdef: nnx.GraphDef, state: dt.TrainState, batch: dict[str, jax.Array]):
    """Correct predictions (running batch-norm averages) among this replica's real rows."""
    model = nnx.merge(graphdef, state.params, state.extra["batch_stats"])
    logits = model(_images(batch), train=False)
    return jnp.sum((jnp.argmax(logits, -1) == batch["label"]) * batch["mask"])


def evaluate(
    strategy: dt.Strategy,
    graphdef: nnx.GraphDef,
    state: dt.TrainState,
    data: dict[str, np.ndarray],
    global_batch_size: int,
) -> float:
    return masked_accuracy(strategy, eval_step, (graphdef, state), data, global_batch_size)


def create_state(config: Config, strategy: dt.Strategy) -> tuple[nnx.GraphDef, dt.TrainState]:
    """A fresh MobileNetV2 and Adam state, created directly replicated on the strategy's devices.

    The model is built inside ``jax.jit``: one compiled initialisation instead of a
    few hundred small eager operations (about 150 layers), which on a busy CPU is
    the difference between seconds and a minute.
    """

    def build() -> MobileNetV2:
        return MobileNetV2(
            num_classes=2,
            width_multiplier=config.width_multiplier,
            bn_axis_name=strategy.axis_name if config.sync_batch_norm else None,
            stages=config.stages,
            rngs=nnx.Rngs(config.seed),
        )

    def init() -> dt.TrainState:
        _, params, stats = nnx.split(build(), nnx.Param, nnx.BatchStat)
        return dt.TrainState.create(
            params=nnx.to_pure_dict(params),
            tx=optax.adam(config.learning_rate),
            batch_stats=nnx.to_pure_dict(stats),
        )

    with strategy.scope():
        graphdef = nnx.split(nnx.eval_shape(build), nnx.Param, nnx.BatchStat)[0]
        replicated = strategy.put_replicated(jnp.zeros(())).sharding
        return graphdef, jax.jit(init, out_shardings=replicated)()


def train(config: Config, strategy: dt.Strategy, *, log: Callable[[str], None] = print) -> Result:
    """Trains with ``strategy``; evaluates on the held-out images after every epoch."""
    train_data, test_data = load_data(config)
    graphdef, state = create_state(config, strategy)
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    pipe = ArrayPipeline(
        train_data,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        num_epochs=config.epochs,
    )
    batches = iter(strategy.experimental_distribute_dataset(pipe))
    log(
        f"MobileNetV2 x{config.width_multiplier} ({num_params:,} parameters) on "
        f"{config.image_size}x{config.image_size} {config.dataset}: "
        f"{strategy.num_replicas_in_sync} replicas, global batch {config.global_batch_size}, "
        f"{pipe.steps_per_epoch} steps per epoch"
    )
    history: list[dict[str, float]] = []
    steps, start = 0, time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        metrics = []
        for _ in range(pipe.steps_per_epoch):
            if config.max_steps is not None and steps >= config.max_steps:
                break
            state, m = strategy.run(train_step, args=(graphdef, state, next(batches)))
            metrics.append(strategy.reduce("sum", m))  # stays on the device
            steps += 1
        if not metrics:
            break
        totals = jax.device_get(metrics)
        accuracy = evaluate(strategy, graphdef, state, test_data, config.global_batch_size)
        record = {
            "epoch": epoch,
            "train_loss": float(np.mean([t["loss"] for t in totals])),
            "train_accuracy": float(sum(t["correct"] for t in totals))
            / (len(totals) * config.global_batch_size),
            "test_accuracy": accuracy,
            "seconds": time.perf_counter() - start,
        }
        history.append(record)
        log(
            f"epoch {epoch:2d}  train loss {record['train_loss']:.4f}  train accuracy "
            f"{record['train_accuracy']:.4f}  test accuracy {accuracy:.4f}  "
            f"{record['seconds']:.0f} s"
        )
    return Result(
        test_accuracy=history[-1]["test_accuracy"] if history else float("nan"),
        history=history,
        steps=steps,
        seconds=time.perf_counter() - start,
        num_replicas=strategy.num_replicas_in_sync,
        num_params=num_params,
        state=state,
    )


def plot_history(history: list[dict[str, float]], path: str, title: str) -> None:
    """Two panels: training loss; training and test accuracy per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3), dpi=80)
    ax1.plot(epochs, [r["train_loss"] for r in history], marker=".")
    ax1.set(xlabel="epoch", ylabel="train loss (cross-entropy)")
    ax2.plot(epochs, [r["train_accuracy"] for r in history], marker=".", label="train")
    ax2.plot(epochs, [r["test_accuracy"] for r in history], marker=".", label="test")
    ax2.set(xlabel="epoch", ylabel="accuracy", ylim=(0.4, 1.01))
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
