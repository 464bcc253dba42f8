"""`IslandCoordinator`: the global state of fault-isolated islands and their rounds.

Each island is its own JAX world (its own processes); the coordinator holds what they
share but the tensors: the membership, the round, the row ledger (``rows.py``), leases,
deadlines and the healing relay, and it checkpoints them after every applied round. The
global parameters and the outer optimizer state live in ``S`` shard holders
(``param_shards.py``; ``IslandsConfig.exchange_shards``, by default one per island):
each island sends shard ``k`` of its pseudo-gradient to holder ``k`` and reads the
round's parameters back from the holders, so no process receives more than its share.
It runs as a threaded Ray actor beside the holders' actors (``remote.py``); the class
itself is plain Python, so it also runs in-process with in-process holders.

A round ``r`` (synchronous mode):

1. the islands enrolled in ``r`` lease rows (:meth:`lease`); round 0 starts when every
   island joined (or ``min_islands`` did and ``start_timeout`` passed), a later round as
   soon as the previous one is applied;
2. each trains ``sync_every`` inner steps on them and submits its pseudo-gradient, the
   global parameters minus its own (:meth:`submit`);
3. when every island of ``r`` still alive submitted, every shard holder applies the
   round (the mean pseudo-gradient weighted by rows through the outer optimizer, on its
   shard) and saves its shard of round ``r + 1``; then the coordinator saves the ledger
   with the leases committed, the commit point; only then the holders serve the new
   parameters (:meth:`wait_round`). The update and the saves run outside the lock, so
   heartbeats go on during a long save; the calls that would change the round
   (``join``, ``submit``) wait for it. A shard or a checkpoint that cannot be saved
   applies nothing and stops the run with the reason in one line (:class:`IslandsFailed`).

An island that sends no heartbeat for ``death_timeout`` seconds (or whose restart joins)
is dead: its unsubmitted lease goes back to the queue and its round closes without it.
So is a *hung* island, one that may still heartbeat but holds a lease longer than the
round deadline, or has not leased that long after its synchronous round started
(``IslandsConfig.round_timeout``; by default derived from the observed round times):
its late submission is refused (`RejoinRequired`), and the survivors learn how long
they waited for it (``Round.hang_s``, charged to the ``hang`` bucket of their goodput
ledgers). A submission that already arrived still counts. An island joining while a
round is under way enrolls in the next one, so survivors never wait for a rejoin; so
does a restarted island whose earlier incarnation already submitted in the open round
(that submission counts there). Below ``min_islands`` live islands the round waits up
to ``min_islands_timeout``, then every call raises. Every call names the island's
*token* (from :meth:`join`): a token the coordinator does not know (a restarted
coordinator, an island declared dead) raises `RejoinRequired`, and the island joins
again from the global state.

*Committed* means saved: a restarted coordinator resumes from its latest checkpoint (and
makes every holder serve its shard of that round, deleting newer ones never committed),
and rows of rounds after it are trained again with the parameters they belong to. The
rows each applied round committed are kept in ``rows/round-R.npy``, so "every row of an
epoch entered exactly one applied round" can be counted from disk. The files and the
directory renames are fsynced; a newest checkpoint that cannot be read, or of which a
holder cannot read its shard (torn by a power loss), is skipped with a warning, and the
coordinator resumes from the one before (``store.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from distrain._src.islands import param_shards, round_commit, store
from distrain._src.islands.healing import Healing, Posted, StateRelay, check_same_optimizer
from distrain._src.islands.islands_config import IslandsConfig as IslandsConfig  # re-exported
from distrain._src.islands.islands_config import IslandsFailed as IslandsFailed  # re-exported
from distrain._src.islands.islands_config import RejoinRequired as RejoinRequired  # re-exported
from distrain._src.islands.islands_config import Round as Round  # re-exported
from distrain._src.islands.islands_config import structure_of as structure_of  # re-exported
from distrain._src.islands.rows import RowLedger
from distrain._src.islands.store import committed_rows as committed_rows  # re-exported

#: The derived round deadline: ``ROUND_TIMEOUT_FACTOR`` x the median lease-to-submit
#: time of the last ``ROUND_TIMES_KEPT`` submissions, at least ``ROUND_TIMEOUT_FLOOR``
#: seconds (an island's first round after it joins also compiles its step).
ROUND_TIMEOUT_FACTOR = 5.0
ROUND_TIMEOUT_FLOOR = 60.0
ROUND_TIMES_KEPT = 20


class _Submission(NamedTuple):
    """One island's submission to the open round (its pseudo-gradient is in the holders)."""

    token: str
    round: int  # the round it named (async: the version it trained from)
    sent: bool  # it sent a pseudo-gradient (not with an empty lease)
    rows: int
    metrics: dict[str, float]
    time: float


class IslandCoordinator:
    """The rounds, the row ledger and the islands' membership; the parameters' holders.

    Args:
      config: the run's :class:`IslandsConfig`.
      params: the initial global parameters as a list of NumPy leaves (with ``holders``,
        only their ``param_shards.LeafSpec``).
      treedef: ``str`` of their tree structure (checked against every joining island).
      outer_optimizer: an optax transformation (DiLoCo: Nesterov SGD, lr 0.7, 0.9).
      directory: where the checkpoints, the committed rows and ``events.jsonl`` go. If
        it holds a checkpoint of the same model, the coordinator resumes from it.
      holders: the shard holders (``remote.RayHolders`` in a run); None: in-process
        ones, made from ``params``.

    Raises:
      ValueError: the directory holds a checkpoint of another model or configuration, of
        another number of shards, or of the star exchange (``store.OldFormat``).

    Example (one island's round, in-process; in a run the calls go through Ray)::

        coord = IslandCoordinator(config, leaves, treedef, optax.sgd(0.7), "runs/x")
        token, _ = coord.join(0, structure)
        r, params, finished, _ = coord.wait_round(0, token, after=-1)
        positions, rows = coord.lease(0, token, r)
        coord.submit(0, token, r, pseudo_gradient)  # global minus the island's params
    """

    def __init__(
        self,
        config: IslandsConfig,
        params: Sequence[np.ndarray],
        treedef: str,
        outer_optimizer: Any,
        directory: str,
        holders: Any = None,
    ) -> None:
        self.config = config
        self.directory = os.path.abspath(directory)
        self.structure = structure_of(params, treedef)
        specs = param_shards.specs_of(params)
        if holders is None:  # in-process: the same holder class, as plain objects
            holders = param_shards.LocalHolders.of(
                self.directory, params, config.shards, outer_optimizer
            )
        self._exchange = param_shards.Exchange(specs, config.shards, holders)
        # A plain lock: _apply releases it around the save, which a re-entrant one
        # acquired twice would not.
        self._cond = threading.Condition(threading.Lock())
        self.round = 0
        self.ledger = RowLedger(config.num_rows, config.epochs, config.seed)
        # island -> token of its live incarnation; members of the open round; the
        # islands enrolled in the next one; submissions of the open round.
        self._tokens: dict[int, str] = {}
        self._heartbeats: dict[int, float] = {}
        self._members: set[int] = set()
        self._next: set[int] = set()
        self._leased: set[int] = set()
        self._submissions: dict[int, _Submission] = {}
        self._pulled: dict[int, int] = {}  # async: the version each island trains from
        self._island_steps: dict[int, int] = {}  # inner steps each island had applied
        self._leased_at: dict[int, float] = {}  # when each unsubmitted lease was taken
        self._joined_at: dict[int, float] = {}  # when each live incarnation joined
        self._round_times: collections.deque[float] = collections.deque(maxlen=ROUND_TIMES_KEPT)
        self._dead: dict[int, str] = {}  # why each island was last declared dead
        # Healing: each live island's optimizer structure, those whose incarnation has
        # submitted (a trained state to give), and the relay of one state to joiners.
        self._optimizers: dict[int, str | None] = {}
        self._seasoned: set[int] = set()
        self._relay = StateRelay()
        self._hung_at: float | None = None  # the open round's last hang verdict
        self._started_at: float | None = None  # sync: the open round's first lease
        self._hang_s = (-1, 0.0)  # the last applied round, its wait for hung islands
        self._saving = False  # a round's update and save are under way, unlocked
        self._opened = time.time()
        self._assembling = True  # until the first lease: wait for every island
        self._below_since: float | None = time.time()
        self._error: str | None = None
        self._created = time.time()
        self._stop = threading.Event()
        os.makedirs(os.path.join(self.directory, "rows"), exist_ok=True)
        restored = self._restore()
        self._event("start", restored_round=restored)
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="islands-watch")
        self._monitor.start()

    # ------------------------------------------------------------- the calls
    def join(
        self, island: int, structure: str, optimizer: str | None = None, heal: bool = False
    ) -> tuple[str, int]:
        """Registers (a new incarnation of) ``island``; returns its token and the inner
        steps of its earlier incarnations that applied rounds kept (its goodput ledger
        counts the rest as lost).

        It is enrolled in the open round if no island leased rows of it yet, else in the
        next one (always the next one if its earlier incarnation submitted in the open
        round); :meth:`wait_round` says when its round opens. It waits for a round's
        save under way. ``optimizer``: the structure of its inner optimizer state;
        ``heal``: it asks for a live peer's state (:meth:`take_state`, ``healing.py``).

        Raises:
          ValueError: another parameter structure, an island id out of range, or
            ``heal`` with an optimizer state unlike a live island's.
          IslandsFailed: the run failed.
        """
        if not 0 <= island < self.config.islands:
            raise ValueError(
                f"island {island} is not one of the {self.config.islands} islands of this run "
                f"(ids 0..{self.config.islands - 1})."
            )
        if structure != self.structure:
            raise ValueError(
                f"island {island} joined with another parameter structure than the "
                f"coordinator's; nothing was applied.\n  coordinator: {self.structure}\n"
                f"  island {island}: {structure}\nEvery island must build the same model "
                "(and a restarted run the model of its checkpoint)."
            )
        with self._cond:
            self._await_save()
            for peer, theirs in self._optimizers.items():  # refused: nothing changes
                if heal and peer != island and theirs is not None:
                    check_same_optimizer(island, peer, theirs, optimizer)
            if island in self._tokens:
                self._declare_dead(island, "it joined again (restarted)")
            self._check_error()
            self._optimizers[island] = optimizer
            if heal:
                self._relay.want(island, optimizer)
            token = uuid.uuid4().hex
            self._tokens[island] = token
            self._heartbeats[island] = self._joined_at[island] = time.time()
            self._dead.pop(island, None)
            short = len(self._members) < self.config.min_islands  # a round that waits
            busy = (self._leased or self._submissions) and not short
            # An earlier incarnation's submission counts in the open round: this one
            # trains the next (leasing the open round again would hold two leases).
            counted = island in self._submissions
            if (busy or counted) and self.config.mode == "sync":
                self._next.add(island)
            else:
                self._members.add(island)
            self._event("join", island=island, round=self.round + (island in self._next))
            self._cond.notify_all()
            return token, self._island_steps.get(island, 0)

    def heartbeat(self, island: int, token: str) -> None:
        with self._cond:
            self._check_token(island, token)
            self._check_error()
            self._heartbeats[island] = time.time()

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
            self._submissions[island] = _Submission(
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
        the final ones."""
        deadline = time.time() + timeout
        with self._cond:
            synchronous = self.config.mode == "sync"
            while not self.ledger.exhausted and (
                (synchronous and self.round <= after)
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
            self._pulled[island] = self.round
            hung_round, hang_s = self._hang_s
            hang_s = hang_s if hung_round == after else 0.0
            joiners = [j for j in self._relay.waiting if j in self._members - self._next]
            donate = island in self._seasoned and self._relay.ask(island, joiners)
            return Round(self.round, self._round_params(), self.ledger.exhausted, hang_s, donate)

    def donate(self, island: int, token: str, round_: int, leaves: list[np.ndarray]) -> bool:
        """``island``'s inner optimizer state at the start of ``round_``, posted because
        :meth:`wait_round` asked (``Round.donate``); False if no joiner waits for it."""
        with self._cond:
            self._check_token(island, token)
            structure = self._optimizers.get(island) or ""
            current = round_ == self.round or self.config.mode == "async"
            kept = current and self._relay.post(
                Posted(island, round_, structure, [np.asarray(x) for x in leaves])
            )
            self._event("donate", island=island, round=round_, kept=kept)
            self._cond.notify_all()
            return kept

    def take_state(
        self, island: int, token: str, round_: int, timeout: float = 2.0
    ) -> Healing | None:
        """A live peer's inner optimizer state for ``island``, which starts ``round_``
        (after ``join(..., heal=True)``). Returns :class:`Healing`: the donor and the
        leaves, or ``donor=None`` and why no live peer can give one (the island starts
        fresh); None if a donor may still post within ``timeout`` s (call again).

        Raises:
          ValueError: the donor's optimizer state is unlike the island's.
        """
        deadline = time.time() + timeout
        with self._cond:
            while True:
                self._check_token(island, token)
                self._check_error()
                synchronous = self.config.mode == "sync"  # async: any peer's boundary
                healing = self._relay.take(island, round_ if synchronous else None)
                if healing is not None:
                    self._event("healed", island=island, round=round_, donor=healing.donor)
                    return healing
                why = self._no_donor(island, round_)
                if why is not None:
                    self._relay.forget(island)
                    self._event("heal_fallback", island=island, round=round_, why=why)
                    return Healing(None, None, why)
                if not self._cond.wait(deadline - time.time()) and time.time() >= deadline:
                    return None

    def leave(self, island: int, token: str) -> None:
        """``island`` finished (every row committed): it stops counting as a member."""
        with self._cond:
            if self._tokens.get(island) == token:
                self._tokens.pop(island)
                self._heartbeats.pop(island, None)
                self._members.discard(island)
                self._next.discard(island)
                self._forget(island)
                self._event("leave", island=island)

    def status(self) -> dict[str, Any]:
        """The round, the live islands, the ledger's counts, the round deadline (for logs
        and tests)."""
        with self._cond:
            return {
                "round": self.round,
                "alive": sorted(self._tokens),
                "members": sorted(self._members),
                "committed_rows": self.ledger.committed,
                "total_rows": self.ledger.total,
                "finished": self.ledger.exhausted,
                "round_deadline_s": self._round_deadline(),
                "healing": sorted(self._relay.waiting),  # joiners waiting for a peer's state
                "healing_bytes_held": self._relay.held_bytes(),
                "error": self._error,
            }

    def params(self) -> list[np.ndarray]:
        """The committed round's parameters, gathered from the holders (tests, logs)."""
        with self._cond:
            return self._exchange.params(self.round) or []

    def _round_params(self) -> list[np.ndarray]:
        """What :meth:`wait_round` returns as the round's parameters: in-process, the
        holders'; the Ray actor returns none, the islands' proxies read the holders."""
        return self._exchange.params(self.round) or []

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------- internals
    def _no_donor(self, island: int, round_: int) -> str | None:
        """Why no live peer can post a state for ``island``'s ``round_``; None while one
        still may (one was asked, or one has not reached that round's boundary yet)."""
        if self._relay.asked in self._tokens:
            return None
        peers = [i for i in self._seasoned if i in self._tokens and i not in self._relay.waiting]
        if not peers:
            return "no live peer has trained a round since it (or the coordinator) started"
        if self.config.mode == "async":
            return None  # the next peer to pull the parameters is asked
        if round_ != self.round or all(self._pulled.get(i, -1) >= round_ for i in peers):
            return f"every live peer had started round {round_} before it could be asked"
        return None

    def _check_token(self, island: int, token: str) -> None:
        if self._tokens.get(island) != token:
            why = self._dead.get(island)
            cause = (
                f"it was declared dead: {why}"
                if why
                else ("it was declared dead, or the coordinator restarted from its checkpoint")
            )
            raise RejoinRequired(
                f"island {island} is not a live member of this coordinator ({cause}): join again."
            )

    def _forget(self, island: int) -> None:
        """``island``'s incarnation ended: it neither heals a joiner nor waits to heal."""
        self._relay.forget(island)
        self._seasoned.discard(island)
        self._optimizers.pop(island, None)

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

    def _round_deadline(self) -> float:
        """Seconds an island may hold a lease without submitting (see
        ``IslandsConfig.round_timeout``)."""
        if self.config.round_timeout is not None:
            return self.config.round_timeout
        observed = float(np.median(self._round_times)) if self._round_times else 0.0
        return max(ROUND_TIMEOUT_FLOOR, ROUND_TIMEOUT_FACTOR * observed)

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
        self._submissions = {island: _Submission(token, round_, sent, rows, metrics, time.time())}
        self._apply(weights={island: rows / self.config.lease_rows})
        self._check_error()
        return True

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

    def _fail(self, reason: str) -> None:
        """Stops the run: every call raises `IslandsFailed` with ``reason``."""
        self._error = reason
        self._event("failed", reason=reason)
        self._cond.notify_all()

    # ------------------------------------------------------------ checkpoint
    def _save(self, r: int, positions: np.ndarray, meta: dict[str, Any]) -> None:
        """Round ``r`` was applied: its committed rows, then the coordinator's state after
        it, durably (``store.py``): the commit point."""
        store.save(self.directory, r, positions, meta)

    def _restore(self) -> int | None:
        """Resumes from the newest checkpoint that reads whole, its shards included
        (``round_commit.restore``); returns its round, or None."""
        meta = round_commit.restore(self.directory, self._exchange, self.structure,
                                    self.config, self._skip)  # fmt: skip
        if meta is not None:
            self.ledger = RowLedger.from_state(meta["ledger"])
            self._island_steps = {int(i): int(n) for i, n in meta["island_steps"].items()}
            self.round = int(meta["round"])
        store.drop_rows_from(self.directory, self.round)  # an abandoned timeline's
        return None if meta is None else self.round

    def _skip(self, line: str) -> None:
        warnings.warn(f"the islands' checkpoint {line}.", stacklevel=5)
        self._event("checkpoint_unreadable", reason=line)

    def _event(self, event: str, **fields: Any) -> None:
        line = {"event": event, "t": time.time(), "pid": os.getpid(), **fields}
        with open(os.path.join(self.directory, "events.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
