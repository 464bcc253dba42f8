"""Helpers shared by the seed examples (each example stays one short program)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import distrain as dt
from distrain.data import ArrayPipeline

DATASETS = ("digits", "mnist")


def load_data(name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(train, test)`` dicts of ``image`` float32 ``[N, H, W, 1]`` and ``label`` int32."""
    if name == "digits":
        return dt.data.load_digits("train"), dt.data.load_digits("test")
    if name == "mnist":  # downloads ~11 MB into ~/.cache/distrain/mnist the first time
        return dt.data.load_mnist("train"), dt.data.load_mnist("test")
    raise ValueError(f"dataset must be one of {DATASETS}; received {name!r}.")


def masked_accuracy(
    strategy: dt.Strategy,
    count_correct: Callable[..., Any],
    args: tuple[Any, ...],
    data: dict[str, np.ndarray],
    global_batch_size: int,
) -> float:
    """Accuracy over ``data`` on all replicas: ``count_correct(*args, batch)`` returns the
    number of correct real rows of a replica's batch; the last batch is padded and masked."""
    pipe = ArrayPipeline(
        data,
        global_batch_size=global_batch_size,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key="mask",
    )
    correct = [
        strategy.reduce("sum", strategy.run(count_correct, args=(*args, batch)))
        for batch in strategy.experimental_distribute_dataset(pipe)
    ]
    return float(jnp.sum(jnp.stack(correct))) / pipe.num_examples


def count_correct(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Correct predictions of the model ``(graphdef, params)`` among this replica's real
    (unpadded) rows of ``batch`` (``image``, ``label``, ``mask``)."""
    logits = nnx.merge(graphdef, params)(batch["image"])
    return jnp.sum((jnp.argmax(logits, -1) == batch["label"]) * batch["mask"])


def evaluate_classifier(
    strategy: dt.Strategy,
    graphdef: nnx.GraphDef,
    params: Any,
    data: dict[str, np.ndarray],
    global_batch_size: int,
) -> float:
    """Accuracy of ``(graphdef, params)`` on ``data``, computed on all replicas."""
    return masked_accuracy(strategy, count_correct, (graphdef, params), data, global_batch_size)
