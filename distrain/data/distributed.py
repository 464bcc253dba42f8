"""Distributed input: global batches in, per-replica batches on the devices out.

A ``DistributedDataset`` wraps any iterable of batches (NumPy or JAX pytrees, grain
datasets and loaders, ``ArrayPipeline``). Each batch is checked (same leading size
for every leaf, divisible by the number of replicas), split across replicas in order,
and copied to the devices ahead of use (``InputOptions.prefetch`` batches, with
asynchronous ``device_put``).

Two kinds of source:

* *global* batches (``experimental_distribute_dataset`` of a plain iterable): every
  process sees the whole batch and copies only the rows of its own replicas;
* *process-local* batches (``distribute_datasets_from_function``, or a source with
  ``process_local = True`` such as ``ArrayPipeline``): each process yields only its
  rows, and the global batch is assembled with ``make_array_from_process_local_data``.

If the source iterator has ``get_state()`` / ``set_state()``, so does the distributed
iterator, counting only the batches the caller consumed (not those prefetched).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from distrain.values import PerReplica

if TYPE_CHECKING:
    from distrain.strategy.base import Strategy


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How a dataset is distributed.

    Attributes:
      drop_remainder: drop a final batch smaller than the first one.
      mask_key: for dict batches: pad a final partial batch to the full size and add
        ``batch[mask_key]`` (1.0 real row, 0.0 padding) to *every* batch, so the
        structure never changes; use it with ``dt.compute_average_loss(..., mask=...)``.
      prefetch: batches copied to the devices ahead of use (0: copy on demand).
    """

    drop_remainder: bool = False
    mask_key: str | None = None
    prefetch: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"`prefetch` must be an int >= 0. Received: {self.prefetch!r}.")
        if self.mask_key is not None and not isinstance(self.mask_key, str):
            raise ValueError(f"`mask_key` must be a str or None. Received: {self.mask_key!r}.")


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a ``dataset_fn`` of ``distribute_datasets_from_function`` needs to know.

    Example:
      >>> def dataset_fn(ctx):
      ...     batch = ctx.get_per_replica_batch_size(GLOBAL) * ctx.num_replicas_in_sync \\
      ...         // ctx.num_input_pipelines
      ...     return ArrayPipeline(data, global_batch_size=GLOBAL,
      ...                          process_index=ctx.input_pipeline_id,
      ...                          process_count=ctx.num_input_pipelines)
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; raises if it does not divide."""
        return _per_replica(global_batch_size, self.num_replicas_in_sync)


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Passed to ``value_fn`` of ``experimental_distribute_values_from_function``."""

    replica_id_in_sync_group: int
    num_replicas_in_sync: int


def input_context(strategy: Strategy) -> InputContext:
    return InputContext(jax.process_count(), jax.process_index(), strategy.num_replicas_in_sync)


def _per_replica(global_batch_size: int, num_replicas: int) -> int:
    if global_batch_size % num_replicas:
        raise ValueError(
            f"The global batch size ({global_batch_size}) must be divisible by the number of "
            f"replicas ({num_replicas}). Use a global batch size that is a multiple of "
            f"{num_replicas}, or pad the last batch with InputOptions(mask_key=...)."
        )
    return global_batch_size // num_replicas


def _batch_size(leaves: list[Any], treedef: Any) -> int:
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        paths = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_leaves_with_path(treedef.unflatten(leaves))
        ]
        shapes = {p: tuple(np.shape(x)) for p, x in zip(paths, leaves, strict=True)}
        raise ValueError(
            "Every leaf of a batch must have the same leading (batch) dimension. "
            f"Received shapes: {shapes}."
        )
    return sizes.pop()


def shard_global_batch(strategy: Strategy, batch: Any) -> PerReplica:
    """Splits a global batch over ``strategy``'s replicas; copies only local rows."""
    leaves, treedef = jax.tree.flatten(batch)
    _per_replica(_batch_size(leaves, treedef), strategy.num_replicas_in_sync)
    sharding = strategy._split
    if all(isinstance(x, jax.Array) and x.sharding == sharding for x in leaves):
        arrays = leaves  # already placed: device_put would still cost ~0.3 ms per batch
    elif jax.process_count() == 1:
        arrays = jax.device_put(leaves, sharding)
    else:
        arrays = [
            jax.make_array_from_callback(np.shape(x), sharding, lambda idx, x=x: np.asarray(x[idx]))
            for x in leaves
        ]
    return PerReplica(treedef.unflatten(arrays), strategy.num_replicas_in_sync)


def shard_local_batch(strategy: Strategy, batch: Any) -> PerReplica:
    """Assembles the global batch from this process's rows."""
    leaves, treedef = jax.tree.flatten(batch)
    local = _batch_size(leaves, treedef)
    n_local = sum(d.process_index == jax.process_index() for d in strategy.devices)
    _per_replica(local, n_local)
    if jax.process_count() == 1:
        arrays = jax.device_put(leaves, strategy._split)
    else:
        arrays = [
            jax.make_array_from_process_local_data(strategy._split, np.asarray(x)) for x in leaves
        ]
    return PerReplica(treedef.unflatten(arrays), strategy.num_replicas_in_sync)


class DistributedDataset:
    """An iterable of per-replica batches; see the module docstring."""

    def __init__(
        self,
        strategy: Strategy,
        dataset: Iterable[Any],
        options: InputOptions | None = None,
        *,
        process_local: bool | None = None,
    ) -> None:
        if not isinstance(dataset, Iterable):
            raise TypeError(
                "Expected an iterable of batches (NumPy/JAX pytrees, a grain dataset or loader, "
                f"or an ArrayPipeline). Received: {type(dataset).__name__}."
            )
        if options is not None and not isinstance(options, InputOptions):
            raise TypeError(f"`options` must be a dt.InputOptions. Received: {options!r}.")
        self._strategy = strategy
        self._dataset = dataset
        self._options = options or InputOptions()
        if process_local is None:
            process_local = bool(getattr(dataset, "process_local", False))
        self._process_local = process_local

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self)


class DistributedIterator:
    """Iterator over per-replica batches, with ``get_state``/``set_state`` when the
    source iterator has them (the position counts consumed batches only).

    Prefetching needs no thread: ``jax.device_put`` is asynchronous, so the copies of
    the next ``prefetch`` batches run while the current step computes.
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._ds = dataset
        self._source = iter(dataset._dataset)
        self._full_size: int | None = None
        self._state: Any = self._source_state()
        self._ahead: collections.deque[tuple[Any, Any]] = collections.deque()
        self._exhausted = False

    # -- state
    def _source_state(self) -> Any:
        get = getattr(self._source, "get_state", None)
        return get() if get is not None else None

    def get_state(self) -> Any:
        """The source's position after the last batch returned by ``next``."""
        if not hasattr(self._source, "get_state"):
            raise TypeError(
                f"This iterator cannot save its position: its source "
                f"({type(self._source).__name__}) has no get_state(). Use dt.data.ArrayPipeline "
                "or a grain iterator."
            )
        return self._state

    def set_state(self, state: Any) -> None:
        """Moves to a position saved by ``get_state`` (drops prefetched batches)."""
        if not hasattr(self._source, "set_state"):
            raise TypeError(
                f"This iterator cannot restore a position: its source "
                f"({type(self._source).__name__}) has no set_state()."
            )
        self._ahead.clear()
        self._exhausted = False
        self._source.set_state(state)
        self._state = state

    # -- iteration
    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> PerReplica:
        # Keep `prefetch` batches in flight beyond the one returned now.
        while not self._exhausted and len(self._ahead) <= self._ds._options.prefetch:
            try:
                self._ahead.append(self._produce())
            except StopIteration:
                self._exhausted = True
            except Exception as e:  # raised when the caller reaches that batch
                self._ahead.append((e, None))
                self._exhausted = True
        if not self._ahead:
            raise StopIteration
        batch, state = self._ahead.popleft()
        if isinstance(batch, Exception):
            raise batch
        self._state = state
        return batch

    def _produce(self) -> tuple[PerReplica, Any]:
        while True:
            batch = self._prepare(next(self._source))
            if batch is not None:
                return self._place(batch), self._source_state()

    # -- one batch
    def _prepare(self, batch: Any) -> Any | None:
        """Validates one batch; pads/masks or drops a partial one. None means skip."""
        opts = self._ds._options
        leaves, treedef = jax.tree.flatten(batch)
        size = _batch_size(leaves, treedef)
        if self._full_size is None:
            self._full_size = size
        partial = size < self._full_size
        if partial and opts.drop_remainder:
            return None
        if opts.mask_key is None:
            return batch
        if not isinstance(batch, dict):
            raise TypeError(
                "InputOptions(mask_key=...) needs dict batches so the mask can be added. "
                f"Received a {type(batch).__name__}."
            )
        if opts.mask_key in batch and not partial:
            return batch
        pad = self._full_size - size
        out = {
            k: np.concatenate(
                [np.asarray(v), np.zeros((pad, *np.shape(v)[1:]), np.asarray(v).dtype)]
            )
            if pad
            else v
            for k, v in batch.items()
            if k != opts.mask_key
        }
        mask = np.asarray(batch.get(opts.mask_key, np.ones(size, np.float32)), np.float32)
        out[opts.mask_key] = np.concatenate([mask, np.zeros(pad, np.float32)])
        return out

    def _place(self, batch: Any) -> PerReplica:
        if self._ds._process_local:
            return shard_local_batch(self._ds._strategy, batch)
        return shard_global_batch(self._ds._strategy, batch)

