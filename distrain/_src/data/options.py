"""What a distributed dataset is told: ``InputOptions`` (how to distribute it),
``InputContext`` (what a ``dataset_fn`` needs to know) and ``ValueContext`` (what a
``value_fn`` needs to know).

``InputContext`` is plain, frozen data. The one thing it records, the global batch
sizes a ``dataset_fn`` asked ``get_per_replica_batch_size`` about, goes to an explicit
``BatchSizeRequests`` that the distributed dataset built from that ``dataset_fn``
owns (``distributed.from_function``): it uses them only to refuse TensorFlow's
per-replica form yielded without ``InputOptions(per_replica_batches=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import final

import jax
import numpy as np

from distrain._src.replicas import Replicas
from distrain._src.validate import is_positive_int


def multiples(n: int, k: int) -> str:
    """The multiples of ``k`` nearest ``n``, for error messages ("56 or 64")."""
    lo = n // k * k
    return f"{lo} or {lo + k}" if lo else f"{k}"


def per_replica_size(global_batch_size: int, num_replicas: int) -> int:
    """``global_batch_size // num_replicas``; refuses an uneven split, saying what divides."""
    if global_batch_size % num_replicas:
        raise ValueError(
            f"The global batch size ({global_batch_size}) must be divisible by the number of "
            f"replicas ({num_replicas}): each replica gets an equal share. Use a "
            f"global batch size that is a multiple of {num_replicas} "
            f"(e.g. {multiples(global_batch_size, num_replicas)})."
        )
    return global_batch_size // num_replicas


@final
class BatchSizeRequests:
    """The global batch size a ``dataset_fn`` passed to ``ctx.get_per_replica_batch_size``
    last (recorded for the distributed dataset built from it; the form of its batches is
    never inferred from it, only a likely mistake refused)."""

    def __init__(self) -> None:
        self.last: int | None = None  # None: never asked

    def record(self, global_batch_size: int) -> None:
        self.last = global_batch_size


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How a dataset is distributed.

    Attributes:
      drop_remainder: drop a final batch smaller than the first one (with unbatched
        per-replica elements: a last step with fewer elements than local replicas).
      mask_key: for dict batches: pad a final partial batch to the first batch's size
        (so no batch may be larger than the first) and add
        ``batch[mask_key]`` (1.0 real row, 0.0 padding) to *every* batch, so the
        structure never changes; use it with ``dt.compute_average_loss(..., mask=...)``.
      prefetch: batches copied to the devices ahead of use (0: copy on demand).
      prefetch_thread: read, check and copy those batches on a background thread, so a
        slow source (a generator that decodes, a grain dataset with transformations)
        overlaps the steps. ``None`` (default): the first 8 batches are read on the
        caller's thread and timed; if the median read takes over 1 ms, reading moves to
        a thread (handing a batch across threads costs microseconds, more than a fast
        source takes). Sources in memory (an ``ArrayPipeline``, a list or tuple of batches)
        stay on the caller's thread. Positions (``get_state``) are exact either way.
      per_replica_batches: for ``distribute_datasets_from_function`` only: whether
        ``dataset_fn`` yields *per-replica* batches (TensorFlow's form, batched by
        ``ctx.get_per_replica_batch_size(GLOBAL)``): each step then takes one batch per
        local replica, as TF does; unbatched elements (a leaf without a batch
        dimension) go one per replica, as TF gives them. ``False``: it yields this
        process's rows of each global batch, split over the local replicas. ``None``
        (default): ``False``,
        except that a ``dataset_fn`` that asked for the per-replica batch size and
        yields batches of that size on several local replicas is refused (each replica
        would silently get a fraction of the batch TF gives it): say which form it is.
    """

    drop_remainder: bool = False
    mask_key: str | None = None
    prefetch: int = 2
    prefetch_thread: bool | None = None
    per_replica_batches: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"`prefetch` must be an int >= 0. Received: {self.prefetch!r}.")
        if self.prefetch_thread not in (None, True, False):
            raise ValueError(
                "`prefetch_thread` must be True, False or None (automatic). Received: "
                f"{self.prefetch_thread!r}."
            )
        if self.mask_key is not None and not isinstance(self.mask_key, str):
            raise ValueError(f"`mask_key` must be a str or None. Received: {self.mask_key!r}.")
        if self.per_replica_batches not in (None, True, False):
            raise ValueError(
                "`per_replica_batches` must be True, False or None. Received: "
                f"{self.per_replica_batches!r}."
            )


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a ``dataset_fn`` of ``distribute_datasets_from_function`` needs to know.

    ``dataset_fn(ctx)`` runs once per process (input pipeline) and yields either

    * distrain's form (default): this process's rows of each global batch
      (``GLOBAL // ctx.num_input_pipelines`` rows), split over the local replicas; or
    * TensorFlow's form, with ``dt.InputOptions(per_replica_batches=True)``:
      *per-replica* batches, batched by ``ctx.get_per_replica_batch_size(GLOBAL)``.
      Each step then takes one batch per local replica, in order (replica ``r`` of
      this process gets the ``r``-th), as TF's round robin over a worker's devices does.

    With one local replica both forms are the same.

    ``requests`` is where ``get_per_replica_batch_size`` records the sizes it is asked
    about: the ``BatchSizeRequests`` of the dataset ``distribute_datasets_from_function``
    builds (used only to refuse TF's form yielded without ``per_replica_batches=True``),
    or ``None`` (nothing is recorded).

    Example (TF's form)::

        def dataset_fn(ctx):
            per_replica = ctx.get_per_replica_batch_size(GLOBAL)
            return ArrayPipeline(shard_of(data, ctx.input_pipeline_id), global_batch_size=
                                 per_replica, process_index=0, process_count=1)

        strategy.distribute_datasets_from_function(
            dataset_fn, dt.InputOptions(per_replica_batches=True))
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1
    requests: BatchSizeRequests | None = dataclasses.field(
        default=None, compare=False, repr=False, kw_only=True
    )

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``.

        Raises:
          TypeError: not an int (a float, a bool: TF's ``compute_average_loss`` raises
            TypeError for a float too).
          ValueError: below 1, or not divisible by the number of replicas.
        """
        if not is_positive_int(global_batch_size):
            is_int = not isinstance(global_batch_size, bool) and isinstance(
                global_batch_size, int | np.integer
            )
            raise (ValueError if is_int else TypeError)(
                "global_batch_size must be a positive int (rows per step over all replicas). "
                f"Received: {global_batch_size!r} ({type(global_batch_size).__name__})."
            )
        per = per_replica_size(int(global_batch_size), self.num_replicas_in_sync)
        if self.requests is not None:
            self.requests.record(int(global_batch_size))
        return per


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Passed to ``value_fn`` of ``experimental_distribute_values_from_function``.

    ``island_id`` is the replica's group of replicas (DiLoCo's island; 0 when the
    strategy has no islands).
    """

    replica_id_in_sync_group: int
    num_replicas_in_sync: int
    island_id: int = 0


def input_context(strategy: Replicas, requests: BatchSizeRequests | None = None) -> InputContext:
    """This process's context for a ``dataset_fn`` of ``strategy`` (recording into
    ``requests``)."""
    return InputContext(
        jax.process_count(),
        jax.process_index(),
        strategy.num_replicas_in_sync,
        requests=requests,
    )
