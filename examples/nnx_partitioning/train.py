"""A flax NNX model that carries its own sharding annotations, trained through them.

The model names its parameters' axes with logical names
(``nnx.with_partitioning(init, ("embed", "mlp"))``, flax's idiom); the strategy takes
the specs straight from the model (``nnx.get_partition_spec(nnx.state(model))``) and
maps the logical names to its replica mesh with ``logical_axis_rules``. The
``train_step`` is the same as for one device.

Flax 0.12 shards an annotated variable as it is created when a mesh is in context, and
refuses to create one with no mesh; ``nnx.use_eager_sharding(False)`` keeps the
annotations as metadata only, and distrain places the values (``put_replicated``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import distrain as dt

MESH = {"fsdp": 4, "tensor": 2}
LOGICAL_AXIS_RULES = {"embed": "fsdp", "mlp": "tensor"}


def _annotated(names: tuple[str | None, ...], init: Callable[..., Any]) -> Callable[..., Any]:
    return nnx.with_partitioning(init, names)


class MLP(nnx.Module):
    """64 -> 256 -> 256 -> 10, the hidden layers split Megatron-style by annotation."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        kernel, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.d1 = nnx.Linear(
            64,
            256,
            kernel_init=_annotated(("embed", "mlp"), kernel),  # columns over "tensor"
            bias_init=_annotated(("mlp",), zeros),
            rngs=rngs,
        )
        self.d2 = nnx.Linear(
            256, 256, kernel_init=_annotated(("mlp", "embed"), kernel), rngs=rngs
        )  # rows over "tensor": partial sums joined inside the replica
        self.out = nnx.Linear(256, 10, kernel_init=_annotated(("embed", None), kernel), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.d2(jax.nn.relu(self.d1(x)))))


def build(seed: int = 0) -> tuple[nnx.GraphDef, Any, Any]:
    """``(graphdef, params, specs)``: the model split, its parameters a pure dict, and
    the specs its annotations give (logical names)."""
    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(seed))
    state = nnx.state(model)
    graphdef, params = nnx.split(model)
    return graphdef, nnx.to_pure_dict(params), nnx.get_partition_spec(state)


def make_train_step(graphdef: nnx.GraphDef) -> Callable[..., Any]:
    def train_step(state: dt.TrainState, batch: dict[str, jax.Array]) -> Any:
        def loss_fn(params: Any) -> jax.Array:
            logits = nnx.merge(graphdef, params)(batch["x"])
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return dt.compute_average_loss(per_example)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step


def train(strategy: dt.Strategy, steps: int = 30, seed: int = 0) -> tuple[Any, list[float]]:
    """Trains on the bundled 8x8 digits; returns the final state and the losses."""
    graphdef, params, _ = build(seed)
    digits = dt.data.load_digits("train")
    data = {"x": digits["image"].reshape(-1, 64).astype(np.float32), "y": digits["label"]}
    pipeline = dt.data.ArrayPipeline(data, global_batch_size=64, seed=seed, num_epochs=None)
    state = dt.TrainState.create(params=params, tx=optax.adam(1e-2))
    trainer = dt.Trainer(strategy, make_train_step(graphdef), log_every=1)
    state, history = trainer.fit(state, pipeline, steps=steps)
    return state, history.history["loss"]


def annotated_strategy() -> dt.MirroredStrategy:
    """One replica of ``MESH`` laid out by the model's own annotations."""
    _, _, specs = build()
    return dt.MirroredStrategy(
        devices_per_replica=MESH, layout=specs, logical_axis_rules=LOGICAL_AXIS_RULES
    )
