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

Its calls are grouped by concept, one base class each, over the state they share under
one lock (``coordinator_state.py``):

- the rounds (``rounds.py``): leases, submissions, and a round's close: when every
  island of round ``r`` still alive submitted, every shard holder applies the round
  (the mean pseudo-gradient weighted by rows through the outer optimizer, on its shard)
  and saves its shard of round ``r + 1``; then the coordinator saves the ledger with the
  leases committed, the commit point; only then the holders serve the new parameters.
  The update and the saves run outside the lock, so heartbeats go on during a long
  save; the calls that would change the round (``join``, ``submit``) wait for it. A
  shard or a checkpoint that cannot be saved applies nothing and stops the run with the
  reason in one line (:class:`IslandsFailed`);
- the liveness (``liveness.py``): an island without a heartbeat for ``death_timeout``
  seconds (or whose restart joins) is dead, its unsubmitted lease goes back to the queue
  and its round closes without it; so is a *hung* island, past the round deadline
  (``IslandsConfig.round_timeout``; by default derived from the observed round times,
  :meth:`IslandCoordinator._round_deadline`): its late submission is refused
  (`RejoinRequired`), and the survivors learn how long they waited for it
  (``Round.hang_s``, charged to the ``hang`` bucket of their goodput ledgers). A
  submission that already arrived still counts. Below ``min_islands`` live islands the
  round waits up to ``min_islands_timeout``, then every call raises;
- the membership (``membership.py``): every call names the island's *token* (from
  ``join``): a token the coordinator does not know (a restarted coordinator, an island
  declared dead) raises `RejoinRequired`, and the island joins again from the global
  state. An island joining while a round is under way enrolls in the next one, so
  survivors never wait for a rejoin; so does a restarted island whose earlier
  incarnation already submitted in the open round (that submission counts there). A
  joiner may heal from a live peer's optimizer state (``healing.py``).

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
import os
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from distrain._src.islands import param_shards, round_commit, store
from distrain._src.islands.coordinator_state import Submission
from distrain._src.islands.healing import StateRelay
from distrain._src.islands.islands_config import IslandsConfig as IslandsConfig  # re-exported
from distrain._src.islands.islands_config import IslandsFailed as IslandsFailed  # re-exported
from distrain._src.islands.islands_config import RejoinRequired as RejoinRequired  # re-exported
from distrain._src.islands.islands_config import Round as Round  # re-exported
from distrain._src.islands.islands_config import structure_of as structure_of  # re-exported
from distrain._src.islands.liveness import Liveness
from distrain._src.islands.membership import Membership
from distrain._src.islands.rounds import Rounds
from distrain._src.islands.rows import RowLedger
from distrain._src.islands.store import committed_rows as committed_rows  # re-exported

#: The derived round deadline: ``ROUND_TIMEOUT_FACTOR`` x the median lease-to-submit
#: time of the last ``ROUND_TIMES_KEPT`` submissions, at least ``ROUND_TIMEOUT_FLOOR``
#: seconds (an island's first round after it joins also compiles its step).
ROUND_TIMEOUT_FACTOR = 5.0
ROUND_TIMEOUT_FLOOR = 60.0
ROUND_TIMES_KEPT = 20


class IslandCoordinator(Membership, Liveness, Rounds):
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
        r, params, finished, _, _ = coord.wait_round(0, token, after=-1)
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
        self._exchange = param_shards.Exchange(specs, config.shards, holders, config.outer_dtype)
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
        self._submissions: dict[int, Submission] = {}
        self._retrying: set[int] = set()  # submitted a round that is trained again
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
    def _round_deadline(self) -> float:
        """Seconds an island may hold a lease without submitting (see
        ``IslandsConfig.round_timeout``)."""
        if self.config.round_timeout is not None:
            return self.config.round_timeout
        observed = float(np.median(self._round_times)) if self._round_times else 0.0
        return max(ROUND_TIMEOUT_FLOOR, ROUND_TIMEOUT_FACTOR * observed)

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
