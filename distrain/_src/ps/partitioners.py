"""Variable partitioners: how many pieces to cut a large variable into.

A partitioner is any callable ``partitioner(shape, dtype) -> list[int]``
that returns the number of partitions along each axis, as in TensorFlow's
`tf.distribute.experimental.partitioners`. Only axis 0 may be split; the
pieces of a split variable are placed on the parameter servers round-robin
(see `distrain._src.ps.variable_layout`).

Example:
    >>> import numpy as np
    >>> FixedShardsPartitioner(2)((10, 3), np.float32)
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=40, max_shards=4)((10, 3), np.float32)
    [3, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Partitioner(Protocol):
    """Callable that tells how many pieces to cut a variable into, per axis."""

    def __call__(self, shape: Sequence[int], dtype: np.dtype) -> list[int]: ...


def _axis0(shape: Sequence[int], num_partitions: int) -> list[int]:
    if len(shape) == 0:
        return []
    return [max(1, min(num_partitions, shape[0]))] + [1] * (len(shape) - 1)


class FixedShardsPartitioner:
    """Cuts every variable into ``num_shards`` pieces along axis 0.

    Variables with fewer than ``num_shards`` rows get one piece per row;
    scalars are never cut.

    Args:
        num_shards: number of pieces, at least 1.

    Raises:
        ValueError: if ``num_shards`` is smaller than 1.
    """

    def __init__(self, num_shards: int):
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(
                f"FixedShardsPartitioner(num_shards) expects an integer >= 1. "
                f"Received: num_shards={num_shards!r}."
            )
        self.num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: np.dtype) -> list[int]:
        return _axis0(shape, self.num_shards)

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards})"


class MinSizePartitioner:
    """Cuts a variable into as many pieces as keep each at least a minimum size.

    Args:
        min_shard_bytes: smallest size of one piece in bytes (default 256 KiB,
            TensorFlow's default).
        max_shards: most pieces per variable (default 1, TensorFlow's
            default; raise it to actually split).

    Raises:
        ValueError: if an argument is smaller than 1.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1):
        for name, value in (("min_shard_bytes", min_shard_bytes), ("max_shards", max_shards)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"MinSizePartitioner({name}) expects an integer >= 1. "
                    f"Received: {name}={value!r}."
                )
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards

    def __call__(self, shape: Sequence[int], dtype: np.dtype) -> list[int]:
        total = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return _axis0(shape, min(self.max_shards, total // self.min_shard_bytes))

    def __repr__(self) -> str:
        return (
            f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, "
            f"max_shards={self.max_shards})"
        )


class MaxSizePartitioner:
    """Cuts a variable into the fewest pieces that keep each under a size.

    Args:
        max_shard_bytes: largest size of one piece in bytes.
        max_shards: most pieces per variable, or None for no limit.

    Raises:
        ValueError: if an argument is smaller than 1.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None):
        if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(
                "MaxSizePartitioner(max_shard_bytes) expects an integer >= 1. "
                f"Received: max_shard_bytes={max_shard_bytes!r}."
            )
        if max_shards is not None and (not isinstance(max_shards, int) or max_shards < 1):
            raise ValueError(
                "MaxSizePartitioner(max_shards) expects None or an integer >= 1. "
                f"Received: max_shards={max_shards!r}."
            )
        self.max_shard_bytes = max_shard_bytes
        self.max_shards = max_shards

    def __call__(self, shape: Sequence[int], dtype: np.dtype) -> list[int]:
        total = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        n = -(-total // self.max_shard_bytes)  # ceil
        if self.max_shards is not None:
            n = min(n, self.max_shards)
        return _axis0(shape, n)

    def __repr__(self) -> str:
        return (
            f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, "
            f"max_shards={self.max_shards})"
        )
