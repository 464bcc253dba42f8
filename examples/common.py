"""Helpers shared by the seed examples (each example stays one short program)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

import distrain as dt
from distrain.data import ArrayPipeline


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
