"""The islands' liveness in the coordinator: heartbeats, deaths and the round deadline.

An island that sends no heartbeat for ``death_timeout`` seconds (or whose restart joins)
is dead: its unsubmitted lease goes back to the queue and its round closes without it.
So is a *hung* island, one that may still heartbeat but holds a lease longer than the
round deadline, or has not leased that long after its synchronous round started
(``IslandsConfig.round_timeout``; by default derived from the observed round times).
Below ``min_islands`` live islands for ``min_islands_timeout``, the run fails. A thread
(:meth:`Liveness._watch`) looks every ``min(0.25, heartbeat_interval / 2)`` seconds.

Example (``coord``: an ``IslandCoordinator``; an island's heartbeat thread)::

    coord.heartbeat(0, token)  # every heartbeat_interval seconds
"""

from __future__ import annotations

import time

from distrain._src.islands.coordinator_state import CoordinatorState


class Liveness(CoordinatorState):
    """The coordinator's heartbeats, and its watcher of dead and hung islands."""

    def heartbeat(self, island: int, token: str) -> None:
        with self._cond:
            self._check_token(island, token)
            self._check_error()
            self._heartbeats[island] = time.time()

    def _declare_dead(self, island: int, why: str, hung: bool = False) -> None:
        returned = 0
        if island in self._leased and island not in self._submissions:
            returned = self.ledger.give_back(island)
            self._leased.discard(island)
        self._leased_at.pop(island, None)
        self._joined_at.pop(island, None)
        self._tokens.pop(island, None)
        self._heartbeats.pop(island, None)
        self._dead[island] = why
        self._forget(island)
        if island not in self._submissions:  # a submission that arrived still counts
            self._members.discard(island)
        self._next.discard(island)
        self._event("dead", island=island, why=why, rows_returned=returned, hung=hung)
        if hung and self.config.mode == "sync":  # the survivors' barrier waited for it
            self._hung_at = time.time()
        if not self._leased and not self._submissions:
            # Nobody trains the open round any more: it starts afresh, joiners included.
            self._members |= self._next
            self._next = set()
            self._started_at = None
        self._maybe_close()
        self._cond.notify_all()

    def _overdue(self) -> tuple[int, str, bool] | None:
        """An island to declare dead now: (island, why, hung), or None."""
        now = time.time()
        for island, seen in self._heartbeats.items():
            if now - seen > self.config.death_timeout:
                return island, f"no heartbeat for {self.config.death_timeout:g} s", False
        deadline = self._round_deadline()
        for island, leased in self._leased_at.items():
            if now - leased > deadline:
                why = f"hung: no submission {deadline:g} s after its lease (the round deadline)"
                return island, why, True
        started = self._started_at
        if self.config.mode == "sync" and started is not None:
            for island in sorted(self._members - self._leased):  # the round waits for them
                # A member that joined the round after it started: from its join.
                if now - max(started, self._joined_at.get(island, started)) > deadline:
                    why = f"hung: no lease {deadline:g} s into its round (the round deadline)"
                    return island, why, True
        return None

    def _watch(self) -> None:
        """Declares islands dead after ``death_timeout`` without a heartbeat, or hung past
        the round deadline; fails the run after ``min_islands_timeout`` below
        ``min_islands``."""
        period = min(0.25, self.config.heartbeat_interval / 2)
        while not self._stop.wait(period):
            with self._cond:
                # One at a time, each against the state the last one left (a death may
                # close the round, whose save releases the lock).
                while self._error is None and (late := self._overdue()) is not None:
                    self._declare_dead(*late)
                alive, now = len(self._tokens), time.time()
                if alive < self.config.min_islands and not self.ledger.exhausted:
                    self._below_since = self._below_since or now
                    if (
                        self._error is None
                        and now - self._below_since > self.config.min_islands_timeout
                    ):
                        self._fail(
                            f"only {alive} island(s) alive, fewer than min_islands="
                            f"{self.config.min_islands}, for more than min_islands_timeout="
                            f"{self.config.min_islands_timeout:g} s (round {self.round}); "
                            "stopping. Restart the islands: the coordinator resumes from its "
                            "checkpoint."
                        )
                else:
                    self._below_since = None
