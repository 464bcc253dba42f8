"""The state that the parts of the islands' `IslandCoordinator` share, under one lock.

The coordinator (``island_coordinator.py``) is one object, one lock and the state below;
its calls are grouped by concept, each part a base class of it:

- ``membership.py``: the islands' tokens, joining, leaving and healing a joiner
  (``join``, ``leave``, ``donate``, ``take_state``);
- ``liveness.py``: heartbeats, and the watcher that declares islands dead (no heartbeat
  for ``death_timeout``) or hung (past the round deadline), or fails the run below
  ``min_islands``;
- ``rounds.py``: a round's leases, submissions, close and commit (``lease``,
  ``submit``, ``wait_round``);
- ``island_coordinator.py``: the state's construction, the checkpoint restored, the
  round deadline, ``status``.

Each part calls the others' hooks (abstract here), and the helpers below, which only
touch the state; every call runs under ``_cond``.

Example (the parts make one concrete class)::

    class IslandCoordinator(Membership, Liveness, Rounds): ...
"""

from __future__ import annotations

import abc
import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from distrain._src.islands import param_shards
from distrain._src.islands.healing import StateRelay
from distrain._src.islands.islands_config import IslandsConfig, IslandsFailed
from distrain._src.islands.rows import RowLedger


class Submission(NamedTuple):
    """One island's submission to the open round (its pseudo-gradient is in the holders)."""

    token: str
    round: int  # the round it named (async: the version it trained from)
    sent: bool  # it sent a pseudo-gradient (not with an empty lease)
    rows: int
    metrics: dict[str, float]
    time: float


class CoordinatorState(abc.ABC):
    """The coordinator's state (set by ``IslandCoordinator.__init__``, which says what
    each field holds), the helpers on it, and the hooks its parts provide."""

    config: IslandsConfig
    directory: str
    structure: str
    round: int
    ledger: RowLedger
    _exchange: param_shards.Exchange
    _cond: threading.Condition
    # Membership: tokens, the open round's members, the next round's, leases, submissions.
    _tokens: dict[int, str]
    _members: set[int]
    _next: set[int]
    _leased: set[int]
    _submissions: dict[int, Submission]
    _retrying: set[int]
    _pulled: dict[int, int]
    _island_steps: dict[int, int]
    # Liveness: last heartbeats, lease and join times, round times, why each died.
    _heartbeats: dict[int, float]
    _leased_at: dict[int, float]
    _joined_at: dict[int, float]
    _round_times: collections.deque[float]
    _dead: dict[int, str]
    # Healing: optimizer structures, islands with a trained state, the relay.
    _optimizers: dict[int, str | None]
    _seasoned: set[int]
    _relay: StateRelay
    # The open round's clock, and the run's.
    _hung_at: float | None
    _started_at: float | None
    _hang_s: tuple[int, float]
    _saving: bool
    _opened: float
    _assembling: bool
    _below_since: float | None
    _error: str | None
    _created: float
    _stop: threading.Event

    # ------------------------------------------------ hooks of the other parts
    @abc.abstractmethod
    def _check_token(self, island: int, token: str) -> None:
        """Raises `RejoinRequired` unless ``token`` is ``island``'s live one (membership)."""

    @abc.abstractmethod
    def _forget(self, island: int) -> None:
        """``island``'s incarnation ended: drops its healing state (membership)."""

    @abc.abstractmethod
    def _declare_dead(self, island: int, why: str, hung: bool = False) -> None:
        """Ends ``island``'s incarnation; its unsubmitted lease goes back (liveness)."""

    @abc.abstractmethod
    def _maybe_close(self) -> None:
        """Applies the open round once every member submitted (rounds)."""

    @abc.abstractmethod
    def _round_deadline(self) -> float:
        """Seconds an island may hold a lease without submitting (the coordinator)."""

    @abc.abstractmethod
    def _round_params(self) -> list[np.ndarray]:
        """The parameters :meth:`wait_round` returns (the coordinator)."""

    @abc.abstractmethod
    def _save(self, r: int, positions: np.ndarray, meta: dict[str, Any]) -> None:
        """Saves round ``r``'s committed rows and the state after it (the coordinator)."""

    # ---------------------------------------------------------------- helpers
    def _check_error(self) -> None:
        if self._error is not None:
            raise IslandsFailed(self._error)

    def _await_save(self) -> None:
        """Waits while a round's update and save run outside the lock (a join or a
        submission would change the round they are closing)."""
        while self._saving:
            self._cond.wait()

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Releases the lock (held by the caller) for slow work: heartbeats go on."""
        self._saving = True
        self._cond.release()
        try:
            yield
        finally:
            self._cond.acquire()
            self._saving = False
            self._cond.notify_all()

    def _fail(self, reason: str) -> None:
        """Stops the run: every call raises `IslandsFailed` with ``reason``."""
        self._error = reason
        self._event("failed", reason=reason)
        self._cond.notify_all()

    def _event(self, event: str, **fields: Any) -> None:
        line = {"event": event, "t": time.time(), "pid": os.getpid(), **fields}
        with open(os.path.join(self.directory, "events.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
