"""What every island and the coordinator agree on: :class:`IslandsConfig`, checked when
it is built, the fingerprint of a pytree that both sides compare (:func:`structure_of`),
what a round's wait returns (:class:`Round`) and the errors an island handles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from distrain._src.islands.codecs import OuterDType


class Round(NamedTuple):
    """What ``IslandCoordinator.wait_round`` returns."""

    round: int
    params: list[np.ndarray]  # the global parameters the round starts from
    finished: bool  # every row was committed: the parameters are the final ones
    hang_s: float  # of the caller's previous round, the wait for islands found hung
    donate: bool = False  # post your inner optimizer state for a joiner (`donate`)


class RejoinRequired(RuntimeError):
    """The coordinator does not know this island's token: join again."""


class IslandsFailed(RuntimeError):
    """The islands cannot go on (fewer than ``min_islands`` alive for too long)."""


@dataclasses.dataclass(frozen=True)
class IslandsConfig:
    """What every island and the coordinator agree on.

    Attributes:
      islands: the islands started (their ids are ``0 .. islands - 1``).
      sync_every: H, the inner steps per round.
      batch_size: the rows of one inner step of one island.
      num_rows: the dataset's rows (one epoch).
      epochs: passes over the dataset.
      seed: seeds one row permutation per epoch (``None``: the dataset's order).
      min_islands: a round is applied only with at least this many live islands.
      death_timeout: seconds without a heartbeat after which an island is dead.
      heartbeat_interval: seconds between an island's heartbeats.
      start_timeout: seconds round 0 waits for every island to join (then it starts with
        the ``min_islands`` or more that did).
      min_islands_timeout: seconds a round waits below ``min_islands`` before the run
        fails.
      mode: ``"sync"``: rounds with a barrier; ``"async"``: each pseudo-gradient is
        applied when it arrives (the outer version counts the updates).
      max_staleness: async only: a pseudo-gradient computed from parameters more than
        this many updates old is discarded and its rows go back to the queue.
      round_timeout: the round deadline: seconds an island may hold a lease without
        submitting, or (synchronous mode) stay without a lease after its round started;
        past it the island is hung and treated as dead (its rows go back to the queue,
        its late submission is refused). ``None``: ``ROUND_TIMEOUT_FACTOR`` (5) x the
        median lease-to-submit time of the last ``ROUND_TIMES_KEPT`` (20) submissions,
        at least ``ROUND_TIMEOUT_FLOOR`` (60 s).
      exchange_shards: the shards the global parameters and the outer optimizer state
        are split into, one holder (a Ray actor) each; every island sends holder ``k``
        shard ``k`` of its pseudo-gradient and reads the parameters back from the
        holders. ``None``: one per island (a holder then receives about one island's
        share of the model per round); ``1``: the star, one holder receives every
        island's whole pseudo-gradient. A resumed run keeps the count it started with.
      outer_dtype: what each island's pseudo-gradient travels to the holders as:
        ``"float32"``, ``"bfloat16"``, ``"int8"`` or ``"int4"`` (absmax per segment,
        ``codecs.py``); the holders average in float32.
    """

    islands: int
    sync_every: int
    batch_size: int
    num_rows: int
    epochs: int = 1
    seed: int | None = 0
    min_islands: int = 1
    death_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    start_timeout: float = 120.0
    min_islands_timeout: float = 300.0
    mode: str = "sync"
    max_staleness: int | None = None
    round_timeout: float | None = None
    exchange_shards: int | None = None
    outer_dtype: OuterDType = "float32"

    def __post_init__(self) -> None:
        from distrain._src.islands.codecs import outer_dtype_name

        object.__setattr__(self, "outer_dtype", outer_dtype_name(self.outer_dtype))
        if self.round_timeout is not None and not self.round_timeout > 0:
            raise ValueError(
                "round_timeout must be None or > 0 seconds (None: derived from the observed "
                f"round times). Received: round_timeout={self.round_timeout!r}."
            )
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async'. Received: mode={self.mode!r}.")
        if self.max_staleness is not None and (self.mode != "async" or self.max_staleness < 0):
            raise ValueError(
                "max_staleness bounds the asynchronous mode: expected mode='async' and "
                f"max_staleness >= 0. Received: mode={self.mode!r}, "
                f"max_staleness={self.max_staleness!r}."
            )
        for name in ("islands", "sync_every", "batch_size", "num_rows", "epochs", "min_islands"):
            if int(getattr(self, name)) < 1:
                raise ValueError(
                    f"IslandsConfig.{name} must be >= 1. Received: {name}={getattr(self, name)!r}."
                )
        if self.exchange_shards is not None and int(self.exchange_shards) < 1:
            raise ValueError(
                "exchange_shards must be None (one shard per island) or >= 1. Received: "
                f"exchange_shards={self.exchange_shards!r}."
            )
        if self.min_islands > self.islands:
            raise ValueError(
                f"min_islands={self.min_islands} is more than the islands started "
                f"(islands={self.islands}): no round could ever be applied. Expected "
                "1 <= min_islands <= islands."
            )
        if not self.heartbeat_interval > 0 or not self.death_timeout > self.heartbeat_interval:
            raise ValueError(
                "Expected 0 < heartbeat_interval < death_timeout (an island must be able to "
                f"send several heartbeats before it counts as dead). Received: "
                f"heartbeat_interval={self.heartbeat_interval!r}, "
                f"death_timeout={self.death_timeout!r}."
            )

    @property
    def lease_rows(self) -> int:
        return self.sync_every * self.batch_size

    @property
    def shards(self) -> int:
        """The parameter shards: ``exchange_shards``, or one per island."""
        return int(self.exchange_shards or self.islands)


def structure_of(leaves: Sequence[np.ndarray], treedef: str) -> str:
    """A fingerprint of a parameter pytree: its tree structure, shapes and dtypes."""
    # ``x.shape``: a leaf's values, or only its shape and dtype (``param_shards.LeafSpec``).
    shapes = ", ".join(
        f"{np.dtype(x.dtype).name}{list(x.shape if hasattr(x, 'shape') else np.shape(x))}"
        for x in leaves
    )
    return f"{treedef} / {shapes}"
