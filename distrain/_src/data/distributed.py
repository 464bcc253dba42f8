"""Distributed input: global batches in, per-replica batches on the devices out.

A ``DistributedDataset`` wraps any iterable of batches (NumPy or JAX pytrees, grain
datasets and loaders, ``ArrayPipeline``); each pass is a ``DistributedIterator``. This
module owns the pass: which source batches make a step, reading ahead, positions.
Each batch is checked and shaped (``batches.py``), split across replicas in order
(``placement.py``) and copied to the devices ahead of use (``InputOptions.prefetch``
batches, with asynchronous ``device_put``; a slow streaming source is read on a
background thread, ``prefetch.py``).

Two kinds of source:

* *global* batches (``experimental_distribute_dataset`` of a plain iterable): every
  process sees the whole batch and copies only the rows of its own replicas;
* *process-local* batches (``distribute_datasets_from_function``, or a source with
  ``process_local = True`` such as ``ArrayPipeline``): each process yields only its
  rows, and the global batch is assembled with ``make_array_from_process_local_data``.
  A ``dataset_fn`` written for TensorFlow (batched by
  ``ctx.get_per_replica_batch_size(global)``) yields per-replica batches instead; with
  ``InputOptions(per_replica_batches=True)`` one is taken per local replica each step,
  as in TF (see ``InputContext``).

On several processes, the processes of a ``distribute_datasets_from_function`` compare
each step's row count first (``agreement.py``): uneven steps are refused everywhere.

If the source iterator has ``get_state()`` / ``set_state()``, so does the distributed
iterator, counting only the batches the caller consumed (not those prefetched).

The dataset and its iterator are one concept in two classes and read each other's
fields; every other module is reached through its public functions.
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from distrain._src.data import agreement as agreement_module
from distrain._src.data import prefetch
from distrain._src.data.batches import (
    BatchShaper,
    Elements,
    Flat,
    batch_size,
    is_unbatched,
    whole_arrays_error,
)
from distrain._src.data.options import BatchSizeRequests, InputContext, InputOptions, input_context
from distrain._src.data.pipeline import ArrayPipeline
from distrain._src.data.placement import local_replicas, place_global, place_local
from distrain._src.replicas import Replicas
from distrain._src.values import PerReplica


def from_function(
    strategy: Replicas, dataset_fn: Callable[[InputContext], Any], options: Any = None
) -> DistributedDataset:
    """``dataset_fn(ctx)`` of this process, distributed as process-local batches; the
    dataset owns the record of the batch sizes ``dataset_fn`` asked ``ctx`` about."""
    requests = BatchSizeRequests()
    ctx = input_context(strategy, requests)
    return DistributedDataset(
        strategy, dataset_fn(ctx), options, process_local=True, input_context=ctx
    )


class DistributedDataset:
    """An iterable of per-replica batches; see the module docstring."""

    def __init__(
        self,
        strategy: Replicas,
        dataset: Iterable[Any],
        options: InputOptions | None = None,
        *,
        process_local: bool | None = None,
        input_context: InputContext | None = None,
        batch_layout: bool = True,
    ) -> None:
        if not isinstance(dataset, Iterable):
            raise TypeError(
                "Expected an iterable of batches (NumPy/JAX pytrees, a grain dataset or loader, "
                f"or an ArrayPipeline). Received: {type(dataset).__name__}."
            )
        whole = whole_arrays_error(dataset)
        if whole is not None:
            raise TypeError(whole)
        if options is not None and not isinstance(options, InputOptions):
            raise TypeError(f"`options` must be a dt.InputOptions. Received: {options!r}.")
        if options is not None and options.per_replica_batches and input_context is None:
            raise ValueError(
                "InputOptions(per_replica_batches=True) is for "
                "strategy.distribute_datasets_from_function, whose dataset_fn may yield "
                "per-replica batches; experimental_distribute_dataset takes global batches. "
                "Drop the option, or build the dataset in a dataset_fn."
            )
        self._strategy = strategy
        self._dataset = dataset
        self._options = options or InputOptions()
        if process_local is None:
            process_local = bool(getattr(dataset, "process_local", False))
        self._process_local = process_local
        self._input_context = input_context
        # False for batches that are not the user's (the Trainer's row ids of a dataset
        # kept on the devices): only their rows are split, never their other dimensions.
        self._batch_layout = batch_layout
        self._last_pass: weakref.ref[DistributedIterator] | None = None

    def _group_size(self, first: Any) -> int:
        """Source batches per step: the local replica count for TF's per-replica form
        (``InputOptions(per_replica_batches=True)``), else 1."""
        ctx, form = self._input_context, self._options.per_replica_batches
        n_local = local_replicas(self._strategy)
        if ctx is None or n_local == 1:
            return 1
        if form:
            return n_local
        asked = ctx.requests.last if ctx.requests is not None else None
        if form is None and asked is not None:
            per_replica = asked // ctx.num_replicas_in_sync
            leaves, treedef = jax.tree.flatten(first)
            if leaves and batch_size(leaves, treedef) == per_replica:
                raise ValueError(
                    f"dataset_fn asked ctx.get_per_replica_batch_size({asked}) "
                    f"and yields batches of that size ({per_replica} rows): TensorFlow's "
                    "form, where each replica gets one such batch. distrain reads a "
                    "dataset_fn's batches as this process's rows by default, and would "
                    f"split {per_replica} rows over this process's {n_local} replicas. Pass "
                    "options=dt.InputOptions(per_replica_batches=True) to give each replica "
                    "one batch as TF does, or per_replica_batches=False if these are this "
                    "process's rows (global_batch_size // ctx.num_input_pipelines)."
                )
        return 1

    @property
    def strategy(self) -> Replicas:
        return self._strategy

    def __iter__(self) -> DistributedIterator:
        # A one-shot source (a generator) is shared by every pass: the previous pass's
        # prefetch thread must stop reading it before this pass does.
        previous = self._last_pass() if self._last_pass is not None else None
        if previous is not None and previous._source is self._dataset:
            previous._stop_feeder()
        it = DistributedIterator(self)
        self._last_pass = weakref.ref(it)
        return it


class DistributedIterator:
    """Iterator over per-replica batches, with ``get_state``/``set_state`` when the
    source iterator has them (the position counts consumed batches only).

    The next ``prefetch`` batches are read and copied ahead: on a background thread
    (``InputOptions.prefetch_thread``), or on the caller's thread between steps, where
    the asynchronous ``jax.device_put`` still overlaps the copies with the step.
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._ds = dataset
        self._source = iter(dataset._dataset)
        self._state: Any = self._source_state()
        self._ahead: collections.deque[tuple[Any, Any]] = collections.deque()
        self._exhausted = False
        self._group: int | None = None  # source batches per step (see _next_batch)
        self._elements = False  # TF's unbatched per-replica elements (see _next_batch)
        opts, source, strategy = dataset._options, dataset._dataset, dataset._strategy
        local = dataset._process_local
        self._n_local = local_replicas(strategy)  # fixed for the pass
        self._shaper = BatchShaper(
            opts,
            self._n_local if local else strategy.num_replicas_in_sync,
            process_batches=local and jax.process_count() > 1,
            array_pipeline=isinstance(source, ArrayPipeline),
        )
        # Each process's dataset_fn decides its rows: the processes check they agree.
        self._agreement = (
            agreement_module.RowAgreement()
            if dataset._input_context is not None and jax.process_count() > 1
            else None
        )
        in_memory = isinstance(source, ArrayPipeline | Sequence)  # no I/O to overlap
        self._threaded = bool(opts.prefetch_thread) and opts.prefetch > 0
        # Automatic: time the first reads here, move to a thread if they are slow.
        self._probe: prefetch.ReadProbe | None = (
            prefetch.ReadProbe()
            if opts.prefetch_thread is None and opts.prefetch > 0 and not in_memory
            else None
        )
        self._feeder: prefetch.PrefetchThread | None = None

    def __del__(self) -> None:
        feeder = getattr(self, "_feeder", None)  # absent if __init__ failed
        if feeder is not None:
            feeder.signal_stop()

    def _stop_feeder(self) -> None:
        """Stops the prefetch thread and waits for it (it may be inside the source)."""
        if self._feeder is None:
            return
        self._feeder.stop()
        self._feeder = None

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
        self._stop_feeder()  # the source is the thread's until it has stopped
        self._ahead.clear()
        self._exhausted = False
        self._source.set_state(state)
        self._state = state

    # -- iteration
    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> PerReplica:
        if self._threaded:
            return self._next_from_thread()
        # Keep `prefetch` batches in flight beyond the one returned now.
        while not self._exhausted and len(self._ahead) <= self._ds._options.prefetch:
            try:
                if self._probe is None:
                    self._ahead.append(self._produce())
                else:
                    start = time.perf_counter()
                    self._ahead.append(self._produce())
                    threaded = self._probe.note(time.perf_counter() - start)
                    if threaded is not None:
                        self._probe = None
                        self._threaded = threaded
            except StopIteration:
                self._exhausted = True
            except Exception as e:  # raised when the caller reaches that batch
                self._ahead.append((e, None))
                self._exhausted = True
        if not self._ahead:
            raise StopIteration
        return self._pop_ahead()

    def _pop_ahead(self) -> PerReplica:
        """The oldest batch read ahead on this thread (or the error reading it raised)."""
        batch, state = self._ahead.popleft()
        if isinstance(batch, Exception):
            raise batch
        self._state = state
        return batch

    def _next_from_thread(self) -> PerReplica:
        if self._ahead:  # read on this thread before reading moved to the thread
            return self._pop_ahead()
        if self._exhausted:
            raise StopIteration
        if self._feeder is None:
            self._feeder = prefetch.PrefetchThread(
                weakref.WeakMethod(self._produce), self._ds._options.prefetch
            )
        item = self._feeder.get()
        if item is prefetch.END or isinstance(item[0], BaseException):
            self._exhausted = True
            self._stop_feeder()
            if item is prefetch.END:
                raise StopIteration
            raise item[0]
        batch, self._state = item
        return batch

    def _produce(self) -> tuple[PerReplica, Any]:
        """The next step's batch, checked and placed, and the source's position after it."""
        agreement = self._agreement
        while True:
            try:
                batch = self._next_batch()
                if isinstance(batch, Elements):
                    prepared = self._shaper.stack(batch.parts, self._n_local)
                else:
                    prepared = self._shaper.prepare(batch)
            except StopIteration:
                if agreement is not None:
                    agreement.agree(agreement_module.END)
                raise
            except Exception:
                if agreement is not None:
                    agreement.agree(agreement_module.FAILED)
                raise
            if prepared is not None:
                if agreement is not None:
                    agreement.agree(prepared[2])
                return self._place(prepared), self._source_state()

    def _next_batch(self) -> Any:
        """The next step's batch: one source batch, or (TF's per-replica form) one per
        local replica, concatenated in replica order (fewer when the source ends).
        Unbatched elements (TF's form only) come back as ``Elements``."""
        first = next(self._source)
        if self._group is None:
            self._group = self._ds._group_size(first)
            self._elements = self._ds._options.per_replica_batches is True and is_unbatched(first)
        if self._group == 1 and not self._elements:
            return first
        parts = [first]
        for _ in range(self._group - 1):
            try:
                parts.append(next(self._source))
            except StopIteration:
                break
        if self._elements:
            return Elements(parts)
        if len(parts) == 1:
            return first
        return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)

    def _place(self, prepared: Flat) -> PerReplica:
        strategy = self._ds._strategy
        layout = self._ds._batch_layout
        if self._elements:  # one element per replica: each replica's component is one row
            split = place_local(strategy, *prepared)
            return PerReplica(split.value, split.num_replicas, stacked=True)
        if self._ds._process_local:
            return place_local(strategy, *prepared, layout=layout)
        return place_global(strategy, *prepared, layout=layout)
