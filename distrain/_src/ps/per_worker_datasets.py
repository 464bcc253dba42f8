"""Per-worker datasets: one input pipeline per worker, read on that worker.

As in TensorFlow, ``coordinator.create_per_worker_dataset(dataset_fn)`` calls
``dataset_fn`` once on every worker and ``iter()`` of the result makes one
iterator per worker. A `PerWorkerIterator` passed in the ``args`` of
``coordinator.schedule`` is resolved on the worker that runs the function:
the step receives that worker's next element. A dataset that runs out raises
`OutOfRangeError` for the function that asked for the element; make
``dataset_fn`` return a repeating dataset to train for any number of steps.

Example:
    >>> def dataset_fn(ctx):  # ctx: dt.InputContext (input_pipeline_id = worker)
    ...     return itertools.cycle(batches[ctx.input_pipeline_id :: ctx.num_input_pipelines])
    >>> per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
    >>> per_worker_iterator = iter(per_worker_dataset)
    >>> coordinator.schedule(step, args=(per_worker_iterator,))
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from distrain._src.ps.errors import OutOfRangeError

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class IteratorRef:
    """What travels to a worker in place of a `PerWorkerIterator`."""

    iterator_id: int
    dataset_id: int


class PerWorkerDataset:
    """A dataset made by ``dataset_fn`` on each worker; ``iter()`` it to schedule with it."""

    def __init__(self, coordinator: Any, dataset_fn: Callable[..., Any]):
        if not callable(dataset_fn):
            raise TypeError(
                "create_per_worker_dataset expects a function that returns a dataset (an "
                f"iterable). Received: {dataset_fn!r}."
            )
        self.coordinator = coordinator
        self.dataset_fn = dataset_fn
        self.dataset_id = next(_ids)

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self)


class PerWorkerIterator:
    """One iterator per worker over a `PerWorkerDataset`; pass it to ``schedule``."""

    def __init__(self, dataset: PerWorkerDataset):
        self.dataset = dataset
        self.ref = IteratorRef(next(_ids), dataset.dataset_id)

    def __next__(self) -> Any:
        raise TypeError(
            "A per-worker iterator has one position per worker and is read on the workers. "
            "Pass it in `coordinator.schedule(step, args=(iterator,))`; the step receives the "
            "next element of the iterator of the worker that runs it."
        )


def _call_dataset_fn(dataset_fn: Callable[..., Any], worker: int, num_workers: int) -> Any:
    try:
        params = inspect.signature(dataset_fn).parameters.values()
        wants_context = any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
        )
    except (TypeError, ValueError):
        wants_context = False
    if not wants_context:
        return dataset_fn()
    from distrain._src.data.options import InputContext

    return dataset_fn(InputContext(num_workers, worker, 1))


class WorkerInputs:
    """The datasets and iterators living on one worker."""

    def __init__(self, worker: int, num_workers: int):
        self.worker = worker
        self.num_workers = num_workers
        self._datasets: dict[int, Any] = {}
        self._iterators: dict[int, tuple[Iterator[Any], list[int]]] = {}

    def resolve(self, tree: Any, dataset_fns: Mapping[int, Callable[..., Any]]) -> Any:
        """Replaces every `IteratorRef` leaf of ``tree`` by this worker's next element."""

        def one(leaf: Any) -> Any:
            return self._next(leaf, dataset_fns) if isinstance(leaf, IteratorRef) else leaf

        return jax.tree.map(one, tree)

    def _next(self, ref: IteratorRef, dataset_fns: Mapping[int, Callable[..., Any]]) -> Any:
        entry = self._iterators.get(ref.iterator_id)
        if entry is None:
            dataset = self._datasets.get(ref.dataset_id)
            if dataset is None:
                fn = dataset_fns[ref.dataset_id]
                dataset = _call_dataset_fn(fn, self.worker, self.num_workers)
                self._datasets[ref.dataset_id] = dataset
            try:
                iterator = iter(dataset)
            except TypeError as e:
                raise TypeError(
                    "dataset_fn of create_per_worker_dataset must return an iterable (a grain "
                    f"dataset, a list of batches, a generator...). Received: {type(dataset)}."
                ) from e
            entry = self._iterators[ref.iterator_id] = (iterator, [0])
        iterator, count = entry
        try:
            element = next(iterator)
        except StopIteration:
            raise OutOfRangeError(
                f"The per-worker dataset of worker {self.worker} ran out after {count[0]} "
                "elements. Expected a repeating dataset (for example grain's `.repeat()` or "
                "`itertools.cycle`) or at most as many scheduled steps as elements per worker."
            ) from None
        count[0] += 1
        return element
