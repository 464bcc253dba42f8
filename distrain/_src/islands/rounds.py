"""The coordinator's rounds: leases, submissions, and a round's close and commit.

A round ``r`` (synchronous mode):

1. the islands enrolled in ``r`` lease rows (:meth:`Rounds.lease`); round 0 starts when
   every island joined (or ``min_islands`` did and ``start_timeout`` passed), a later
   round as soon as the previous one is applied;
2. each trains ``sync_every`` inner steps on them and submits its pseudo-gradient, the
   global parameters minus its own (:meth:`Rounds.submit`);
3. when every island of ``r`` still alive submitted, every shard holder applies the
   round and saves its shard of round ``r + 1``; then the coordinator saves the ledger
   with the leases committed, the commit point (``round_commit.py``); only then the
   holders serve the new parameters (:meth:`Rounds.wait_round`). If a holder lost a
   pseudo-gradient of ``r`` (it restarted), nothing is applied: the round's rows go back
   to the queue and its islands train ``r`` again from the same parameters.

In the asynchronous mode each submission is applied at once, unless it is staler than
``max_staleness`` updates.

Example (``coord``: an ``IslandCoordinator``; one island's round)::

    r, params, finished, _, _ = coord.wait_round(0, token, after=-1)
    positions, rows = coord.lease(0, token, r)
    coord.submit(0, token, r, pseudo_gradient)  # global minus the island's params
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from distrain._src.islands import round_commit
from distrain._src.islands.coordinator_state import CoordinatorState, Submission
from distrain._src.islands.islands_config import RejoinRequired, Round


class Rounds(CoordinatorState):
    """The coordinator's calls of a round, and its close."""

    def lease(
        self, island: int, token: str, round_: int, timeout: float = 2.0
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Rows for ``island`` in round ``round_``: (positions in the ledger's stream,
        row indices into the dataset).

        Returns None if the round has not started within ``timeout`` seconds (call
        again); empty arrays once the stream of rows is used up.
        """
        deadline = time.time() + timeout
        with self._cond:
            while True:
                self._check_token(island, token)
                self._check_error()
                asynchronous = self.config.mode == "async"
                if island in self._next:
                    raise RejoinRequired(
                        f"island {island} asked for rows of round {round_}, but it is enrolled "
                        f"in round {self.round + 1} (it joined while round {self.round} was "
                        "under way): wait for its round with wait_round."
                    )
                if island not in self._members or (round_ != self.round and not asynchronous):
                    raise RejoinRequired(
                        f"island {island} asked for rows of round {round_}, but the open round "
                        f"is {self.round} and it is not enrolled in it."
                    )
                drained = self.ledger.next == self.ledger.total and not self.ledger.returned
                if asynchronous and drained and not self.ledger.exhausted:
                    pass  # others hold the last rows: one may die and give them back
                elif self._leased or self._may_start():
                    break
                if not self._cond.wait(deadline - time.time()) and time.time() >= deadline:
                    return None
            self._assembling = False
            if not self._leased:
                self._started_at = time.time()
            self._leased.add(island)
            self._leased_at[island] = time.time()
            positions = self.ledger.lease(island, self.config.lease_rows)
            return positions, self.ledger.rows(positions)[1]

    def submit(
        self,
        island: int,
        token: str,
        round_: int,
        pseudo_gradient: list[np.ndarray] | None,
        metrics: dict[str, float] | None = None,
    ) -> bool:
        """``island``'s pseudo-gradient for ``round_`` (None with an empty lease): its
        shards go to the holders, then :meth:`submit_sent` (what the proxy of ``remote.py``
        does in a run).

        Returns False when the asynchronous mode discarded it as too stale (its rows go
        back to the queue), else True.

        Raises:
          RejoinRequired: ``island`` holds no lease of ``round_`` (it was declared dead,
            hung past the round deadline included: its submission is discarded).
          ValueError: the pseudo-gradient's shapes are not the parameters'.
          IslandsFailed: the run failed (e.g. the round's checkpoint could not be saved).
        """
        if pseudo_gradient is not None:
            self._exchange.put(island, token, round_, pseudo_gradient)
        return self.submit_sent(island, token, round_, pseudo_gradient is not None, metrics)

    def submit_sent(
        self,
        island: int,
        token: str,
        round_: int,
        sent: bool,
        metrics: dict[str, float] | None = None,
    ) -> bool:
        """:meth:`submit` once ``island`` has put its pseudo-gradient's shards to the
        holders (``sent``; False with an empty lease): its rows and metrics."""
        arrived = time.time()
        with self._cond:
            self._await_save()
            self._check_token(island, token)
            self._check_error()
            stale_round = round_ != self.round and self.config.mode == "sync"
            if stale_round or island not in self._leased or island in self._submissions:
                raise RejoinRequired(
                    f"island {island} submitted for round {round_} without a lease of it (open "
                    f"round {self.round})."
                )
            if island in self._leased_at:  # a lease of an earlier attempt has no time
                self._round_times.append(arrived - self._leased_at.pop(island))
            self._heartbeats[island] = time.time()
            self._seasoned.add(island)  # its state is a trained one: it may heal a joiner
            if self.config.mode == "async":
                return self._submit_async(island, token, round_, sent, dict(metrics or {}))
            rows = self.ledger.submitted(island)
            self._submissions[island] = Submission(
                token, round_, sent, rows, dict(metrics or {}), arrived
            )
            self._maybe_close()
            self._check_error()  # the save of the round this submission closed failed
            return True

    def wait_round(self, island: int, token: str, after: int, timeout: float = 2.0) -> Round | None:
        """Waits for a round after ``after`` that ``island`` is enrolled in (``after=-1``
        after joining). Returns a :class:`Round` (that round, the global parameters it
        starts from, finished, and ``hang_s``: the seconds round ``after`` waited for
        islands declared hung after the others submitted), or None after ``timeout``
        seconds (call again). ``finished``: every row was committed; the parameters are
        the final ones. The round is ``after`` again when it was not applied and
        ``island`` trains it again (a shard holder lost a pseudo-gradient of it)."""
        deadline = time.time() + timeout
        with self._cond:
            synchronous = self.config.mode == "sync"
            while not self.ledger.exhausted and (
                (synchronous and self.round <= after and island not in self._retrying)
                or island not in self._members
                or island in self._next
            ):
                self._check_token(island, token)
                self._check_error()
                remaining = deadline - time.time()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            self._check_token(island, token)
            self._retrying.discard(island)
            self._pulled[island] = self.round
            hung_round, hang_s = self._hang_s
            hang_s = hang_s if hung_round == after else 0.0
            joiners = [j for j in self._relay.waiting if j in self._members - self._next]
            donate = island in self._seasoned and self._relay.ask(island, joiners)
            return Round(self.round, self._round_params(), self.ledger.exhausted, hang_s, donate)

    # ------------------------------------------------------------- internals
    def _may_start(self) -> bool:
        """Round 0 waits for every island (or ``min_islands`` after ``start_timeout``);
        a later round needs ``min_islands`` members."""
        n = len(self._members)
        if self._assembling:  # a fresh or restored coordinator: wait for every island
            waited = time.time() - self._created
            return n == self.config.islands or (
                n >= self.config.min_islands and waited >= self.config.start_timeout
            )
        return n >= self.config.min_islands

    def _maybe_close(self) -> None:
        """Applies the open round once every member still in it submitted, if they are at
        least ``min_islands`` (else it waits for a joiner, which enrolls in it)."""
        if (
            self.config.mode == "sync"
            and not self._saving
            and self._error is None
            and len(self._submissions) >= self.config.min_islands
            and all(i in self._submissions for i in self._members)
        ):
            self._apply()

    def _apply(self, weights: dict[int, float] | None = None) -> None:
        """Applies the submissions' mean pseudo-gradient, weighted by rows (an empty
        lease weighs nothing; async: ``weights``), commits their rows and saves; the
        holders serve the new parameters only once the coordinator's checkpoint, the
        commit point, is saved. The update and the saves run without the lock
        (heartbeats go on), from a snapshot: the submissions and the ledger's state with
        their rows committed."""
        ready = time.time()  # every member submitted or was declared dead
        r, subs = self.round, dict(self._submissions)
        islands = sorted(subs)
        positions = self.ledger.pending_of(islands)
        island_steps = dict(self._island_steps)
        for i in islands:
            island_steps[i] = island_steps.get(i, 0) - (-subs[i].rows // self.config.batch_size)
        last_submit = max(s.time for s in subs.values())
        hang_s = max(0.0, self._hung_at - last_submit) if self._hung_at is not None else 0.0
        sent = [i for i in islands if subs[i].sent and subs[i].rows]
        total = sum(subs[i].rows for i in sent)
        weights = weights or {i: subs[i].rows / total for i in sent}
        entries = [(i, subs[i].token, subs[i].round, weights[i]) for i in sent]
        meta = {
            "round": r + 1,
            "structure": self.structure,
            "config": dataclasses.asdict(self.config),
            "shards": self.config.shards,
            "ledger": self.ledger.state_dict(committing=islands),
            "island_steps": {str(i): n for i, n in island_steps.items()},
        }
        with self._unlocked():
            failure = round_commit.commit(
                self._exchange, lambda: self._save(r, positions, meta), r, entries,
                self.directory,
            )  # fmt: skip
        if failure is not None and failure.startswith(round_commit.LOST):
            if self.config.mode == "sync":
                self._retry(r, islands, failure.removeprefix(round_commit.LOST))
                return
            failure = failure.removeprefix(round_commit.LOST)
        if failure is not None and not failure.startswith(round_commit.INSTALLED):
            self._event("save_failed", round=r, error=failure)
            self._fail(
                f"round {r}'s {failure}; the round was not applied, and the run "
                "stops. Fix the cause and start the islands again: the coordinator resumes "
                f"from its last checkpoint, the state round {r} started from."
            )
            return
        self.ledger.commit(islands)
        self._island_steps = island_steps
        self._event(
            "round",
            round=r,
            islands=islands,
            rows={str(i): subs[i].rows for i in islands},
            metrics={str(i): subs[i].metrics for i in islands},
            opened=self._opened,
            last_submit=last_submit,
            ready=ready,
            hang_s=hang_s,
            closed=time.time(),
        )
        self.round += 1
        if self.config.mode == "sync":
            self._members = {i for i in self._members if i in self._tokens} | self._next
            self._next = set()
            self._relay.drop_before(self.round)
        self._leased -= set(islands)
        self._submissions.clear()
        self._hung_at, self._started_at, self._hang_s = None, None, (r, hang_s)
        self._opened = time.time()
        if failure is not None:  # committed on disk, but a holder does not serve it
            self._fail(
                f"round {r} was committed, but a shard holder could not serve round {r + 1} "
                f"({failure.removeprefix(round_commit.INSTALLED)}); the run stops. Start the "
                f"islands again: the coordinator resumes from round {r + 1}."
            )
        self._cond.notify_all()

    def _retry(self, r: int, islands: list[int], why: str) -> None:
        """Round ``r`` was not applied because a shard holder lost a pseudo-gradient of it
        (a restart): its rows go back to the queue's front and the islands that submitted
        it train it again, from the same parameters (:meth:`wait_round` gives them ``r``
        again). The other holders' copies are replaced when the islands submit again."""
        returned = self.ledger.retry(islands)
        self._leased -= set(islands)
        self._submissions.clear()
        self._retrying |= set(islands)
        self._hung_at = self._started_at = None
        self._event("round_retried", round=r, islands=islands, rows_returned=returned,
                    error=why)  # fmt: skip
        self._cond.notify_all()

    def _submit_async(
        self, island: int, token: str, round_: int, sent: bool, metrics: dict[str, float]
    ) -> bool:
        """Applies one island's pseudo-gradient now (weighted by its share of a full
        lease), unless it is staler than ``max_staleness`` updates."""
        staleness = self.round - self._pulled.get(island, self.round)
        bound = self.config.max_staleness
        if bound is not None and staleness > bound:
            returned = self.ledger.give_back(island)
            self._leased.discard(island)
            self._event("stale", island=island, staleness=staleness, rows_returned=returned)
            self._cond.notify_all()
            return False
        rows = self.ledger.submitted(island)
        if not sent:  # an empty lease: nothing to apply or commit
            self.ledger.commit([island])
            self._leased.discard(island)
            self._cond.notify_all()
            return True
        # Alone in its "round": the weighted mean is its own, scaled by its share of a lease.
        metrics = {**metrics, "staleness": staleness}
        self._submissions = {island: Submission(token, round_, sent, rows, metrics, time.time())}
        self._apply(weights={island: rows / self.config.lease_rows})
        self._check_error()
        return True
