"""`IslandCoordinator`: the global state of fault-isolated islands and their rounds.

Each island is its own JAX world (its own processes); the coordinator holds what they
share: the global parameters, the outer optimizer state, the round and the row ledger
(``rows.py``), and it checkpoints them together after every applied round. It runs as
a threaded Ray actor (``remote.py``); the class itself is plain Python and NumPy
plus one jitted optax update on the CPU, so it also runs in-process.

A round ``r`` (synchronous mode):

1. the islands enrolled in ``r`` lease rows (:meth:`lease`); round 0 starts when every
   island joined (or ``min_islands`` did and ``start_timeout`` passed), a later round as
   soon as the previous one is applied;
2. each trains ``sync_every`` inner steps on them and submits its pseudo-gradient, the
   global parameters minus its own (:meth:`submit`);
3. when every island of ``r`` still alive submitted, the mean pseudo-gradient weighted
   by rows goes through the outer optimizer, the leases are committed, the state and
   the ledger are saved in one checkpoint step, and only then the islands see the new
   parameters (:meth:`wait_round`).

An island that sends no heartbeat for ``death_timeout`` seconds (or whose restart joins)
is dead: its unsubmitted lease goes back to the queue and its round closes without it.
A submission that already arrived still counts. An island joining while a round is
under way enrolls in the next one, so survivors never wait for a rejoin. Below
``min_islands`` live islands the round waits up to ``min_islands_timeout``, then every
call raises. Every call names the island's *token* (from :meth:`join`): a token the
coordinator does not know (a restarted coordinator, an island declared dead) raises
`RejoinRequired`, and the island joins again from the global state.

*Committed* means saved: a restarted coordinator resumes from its latest checkpoint,
and rows of rounds after it are trained again with the parameters they belong to. The
rows each applied round committed are kept in ``rows/round-R.npy``, so "every row of an
epoch entered exactly one applied round" can be counted from disk.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from distrain._src.islands.rows import RowLedger

CHECKPOINTS_KEPT = 2


class _Submission(NamedTuple):
    """One island's submission to the open round."""

    grads: list[np.ndarray] | None  # None with an empty lease
    rows: int
    metrics: dict[str, float]
    time: float


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

    def __post_init__(self) -> None:
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


def structure_of(leaves: Sequence[np.ndarray], treedef: str) -> str:
    """A fingerprint of a parameter pytree: its tree structure, shapes and dtypes."""
    shapes = ", ".join(f"{np.dtype(x.dtype).name}{list(np.shape(x))}" for x in leaves)
    return f"{treedef} / {shapes}"


class IslandCoordinator:
    """The global parameters, the outer optimizer, the rounds and the row ledger.

    Args:
      config: the run's :class:`IslandsConfig`.
      params: the initial global parameters as a list of NumPy leaves.
      treedef: ``str`` of their tree structure (checked against every joining island).
      outer_optimizer: an optax transformation (DiLoCo: Nesterov SGD, lr 0.7, 0.9).
      directory: where the checkpoints, the committed rows and ``events.jsonl`` go. If
        it holds a checkpoint of the same model, the coordinator resumes from it.

    Raises:
      ValueError: the directory holds a checkpoint of another model or configuration.

    Example (one island's round, in-process; in a run the calls go through Ray)::

        coord = IslandCoordinator(config, leaves, treedef, optax.sgd(0.7), "runs/x")
        token, _ = coord.join(0, structure)
        r, params, finished = coord.wait_round(0, token, after=-1)
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
    ) -> None:
        import jax
        import jax.numpy as jnp

        from distrain._src.islands.outer import outer_update

        self.config = config
        self.directory = os.path.abspath(directory)
        self.structure = structure_of(params, treedef)
        self._cond = threading.Condition()
        self._params = [np.asarray(p) for p in params]
        opt_state = outer_optimizer.init([jnp.asarray(p) for p in self._params])
        self._opt_leaves, self._opt_def = jax.tree.flatten(opt_state)
        self._opt_leaves = [np.asarray(x) for x in self._opt_leaves]
        self._update = jax.jit(functools.partial(outer_update, outer_optimizer))
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
    def join(self, island: int, structure: str) -> tuple[str, int]:
        """Registers (a new incarnation of) ``island``; returns its token and the inner
        steps of its earlier incarnations that applied rounds kept (its goodput ledger
        counts the rest as lost).

        It is enrolled in the open round if no island leased rows of it yet, else in the
        next one; :meth:`wait_round` says when its round opens.

        Raises:
          ValueError: another parameter structure, or an island id out of range.
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
            self._check_error()
            if island in self._tokens:
                self._declare_dead(island, "it joined again (restarted)")
            token = uuid.uuid4().hex
            self._tokens[island] = token
            self._heartbeats[island] = time.time()
            short = len(self._members) < self.config.min_islands  # a round that waits
            busy = (self._leased or self._submissions) and not short
            if busy and self.config.mode == "sync":
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
            self._leased.add(island)
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
        """``island``'s pseudo-gradient for ``round_`` (None with an empty lease).

        Returns False when the asynchronous mode discarded it as too stale (its rows go
        back to the queue), else True."""
        with self._cond:
            self._check_token(island, token)
            self._check_error()
            stale_round = round_ != self.round and self.config.mode == "sync"
            if stale_round or island not in self._leased or island in self._submissions:
                raise RejoinRequired(
                    f"island {island} submitted for round {round_} without a lease of it (open "
                    f"round {self.round})."
                )
            if pseudo_gradient is not None:
                shapes = [np.shape(g) for g in pseudo_gradient]
                if shapes != [np.shape(p) for p in self._params]:
                    raise ValueError(
                        f"island {island}'s pseudo-gradient has shapes {shapes}; the global "
                        f"parameters have {[np.shape(p) for p in self._params]}. Nothing was "
                        "applied."
                    )
            if self.config.mode == "async":
                return self._submit_async(island, pseudo_gradient, dict(metrics or {}))
            rows = self.ledger.submitted(island)
            now = time.time()
            self._submissions[island] = _Submission(pseudo_gradient, rows, dict(metrics or {}), now)
            self._heartbeats[island] = now
            self._maybe_close()
            return True

    def wait_round(
        self, island: int, token: str, after: int, timeout: float = 2.0
    ) -> tuple[int, list[np.ndarray], bool] | None:
        """Waits for a round after ``after`` that ``island`` is enrolled in (``after=-1``
        after joining). Returns (that round, the global parameters it starts from,
        finished), or None after ``timeout`` seconds (call again). ``finished``: every
        row was committed; the parameters are the final ones."""
        deadline = time.time() + timeout
        with self._cond:
            synchronous = self.config.mode == "sync"
            while not self.ledger.exhausted and (
                (synchronous and self.round <= after) or island not in self._members
            ):
                self._check_token(island, token)
                self._check_error()
                remaining = deadline - time.time()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            self._check_token(island, token)
            self._pulled[island] = self.round
            return self.round, list(self._params), self.ledger.exhausted

    def leave(self, island: int, token: str) -> None:
        """``island`` finished (every row committed): it stops counting as a member."""
        with self._cond:
            if self._tokens.get(island) == token:
                self._tokens.pop(island)
                self._heartbeats.pop(island, None)
                self._members.discard(island)
                self._event("leave", island=island)

    def status(self) -> dict[str, Any]:
        """The round, the live islands, the ledger's counts (for logs and tests)."""
        with self._cond:
            return {
                "round": self.round,
                "alive": sorted(self._tokens),
                "members": sorted(self._members),
                "committed_rows": self.ledger.committed,
                "total_rows": self.ledger.total,
                "finished": self.ledger.exhausted,
                "error": self._error,
            }

    def params(self) -> list[np.ndarray]:
        with self._cond:
            return list(self._params)

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------- internals
    def _check_token(self, island: int, token: str) -> None:
        if self._tokens.get(island) != token:
            raise RejoinRequired(
                f"island {island} is not a live member of this coordinator (it was declared "
                "dead, or the coordinator restarted from its checkpoint): join again."
            )

    def _check_error(self) -> None:
        if self._error is not None:
            raise IslandsFailed(self._error)

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

    def _declare_dead(self, island: int, why: str) -> None:
        returned = 0
        if island in self._leased and island not in self._submissions:
            returned = self.ledger.give_back(island)
            self._leased.discard(island)
        self._tokens.pop(island, None)
        self._heartbeats.pop(island, None)
        if island not in self._submissions:  # a submission that arrived still counts
            self._members.discard(island)
        self._next.discard(island)
        self._event("dead", island=island, why=why, rows_returned=returned)
        if not self._leased and not self._submissions:
            # Nobody trains the open round any more: it starts afresh, joiners included.
            self._members |= self._next
            self._next = set()
        self._maybe_close()
        self._cond.notify_all()

    def _maybe_close(self) -> None:
        """Applies the open round once every member still in it submitted, if they are at
        least ``min_islands`` (else it waits for a joiner, which enrolls in it)."""
        if (
            self.config.mode == "sync"
            and len(self._submissions) >= self.config.min_islands
            and all(i in self._submissions for i in self._members)
        ):
            self._apply()

    def _apply(self) -> None:
        """Applies the submissions' mean pseudo-gradient, weighted by rows (an empty
        lease weighs nothing), commits their rows and saves."""
        import jax

        now = time.time()
        subs = self._submissions
        grads = [(s.grads, s.rows) for s in subs.values() if s.grads is not None and s.rows]
        total = sum(n for _, n in grads)
        if total:  # the pseudo-gradients are float32 or wider (outer.py's pseudo_gradient)
            mean = [sum(g[k] * (n / total) for g, n in grads) for k in range(len(self._params))]
            opt = jax.tree.unflatten(self._opt_def, self._opt_leaves)
            params, opt = self._update(self._params, opt, mean)
            self._params = [np.asarray(p) for p in params]
            self._opt_leaves = [np.asarray(x) for x in jax.tree.leaves(opt)]
        islands = sorted(subs)
        positions = self.ledger.commit(islands)
        for i in islands:
            steps = -(-subs[i].rows // self.config.batch_size)
            self._island_steps[i] = self._island_steps.get(i, 0) + steps
        record = {
            "round": self.round,
            "islands": islands,
            "rows": {str(i): subs[i].rows for i in islands},
            "metrics": {str(i): subs[i].metrics for i in islands},
            "opened": self._opened,
            "last_submit": max(s.time for s in subs.values()),
            "ready": now,  # every member submitted or was declared dead
        }
        self._save(positions)
        record["closed"] = time.time()
        self._event("round", **record)
        self.round += 1
        if self.config.mode == "sync":
            self._members = {i for i in self._members if i in self._tokens} | self._next
            self._next = set()
        self._leased -= set(islands)
        self._submissions.clear()
        self._opened = time.time()
        self._cond.notify_all()

    def _submit_async(
        self, island: int, pseudo_gradient: list[np.ndarray] | None, metrics: dict[str, float]
    ) -> bool:
        """Applies one island's pseudo-gradient now (weighted by its share of a full
        lease), unless it is staler than ``max_staleness`` updates."""
        staleness = self.round - self._pulled.get(island, self.round)
        bound = self.config.max_staleness
        self._heartbeats[island] = time.time()
        if bound is not None and staleness > bound:
            returned = self.ledger.give_back(island)
            self._leased.discard(island)
            self._event("stale", island=island, staleness=staleness, rows_returned=returned)
            self._cond.notify_all()
            return False
        rows = self.ledger.submitted(island)
        if pseudo_gradient is None:  # an empty lease: nothing to apply or commit
            self.ledger.commit([island])
            self._leased.discard(island)
            self._cond.notify_all()
            return True
        # Alone in its "round": the weighted mean is its own, scaled by its share of a lease.
        grads = [np.asarray(g) * (rows / self.config.lease_rows) for g in pseudo_gradient]
        metrics = {**metrics, "staleness": staleness}
        self._submissions = {island: _Submission(grads, rows, metrics, time.time())}
        self._apply()
        return True

    def _watch(self) -> None:
        """Declares islands dead after ``death_timeout`` without a heartbeat; fails the run
        after ``min_islands_timeout`` below ``min_islands``."""
        period = min(0.25, self.config.heartbeat_interval / 2)
        while not self._stop.wait(period):
            with self._cond:
                now = time.time()
                for island, seen in list(self._heartbeats.items()):
                    if now - seen > self.config.death_timeout:
                        self._declare_dead(
                            island, f"no heartbeat for {self.config.death_timeout:g} s"
                        )
                alive = len(self._tokens)
                if alive < self.config.min_islands and not self.ledger.exhausted:
                    self._below_since = self._below_since or now
                    if now - self._below_since > self.config.min_islands_timeout:
                        self._error = (
                            f"only {alive} island(s) alive, fewer than min_islands="
                            f"{self.config.min_islands}, for more than min_islands_timeout="
                            f"{self.config.min_islands_timeout:g} s (round {self.round}); "
                            "stopping. Restart the islands: the coordinator resumes from its "
                            "checkpoint."
                        )
                        self._event("failed", reason=self._error)
                        self._cond.notify_all()
                else:
                    self._below_since = None

    # ------------------------------------------------------------ checkpoint
    def _ckpt_dir(self, round_: int) -> str:
        return os.path.join(self.directory, "checkpoints", f"round-{round_:07d}")

    def _save(self, positions: np.ndarray) -> None:
        """Round ``self.round`` was applied: its committed rows, then the state after it
        (params, outer optimizer state, ledger) in one directory, renamed into place."""
        r = self.round
        rows_path = os.path.join(self.directory, "rows", f"round-{r:07d}.npy")
        np.save(rows_path + ".tmp.npy", positions)
        os.replace(rows_path + ".tmp.npy", rows_path)
        final = self._ckpt_dir(r + 1)  # the state a round r + 1 starts from
        tmp = final + f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        arrays = {f"p{k}": p for k, p in enumerate(self._params)}
        arrays.update({f"o{k}": x for k, x in enumerate(self._opt_leaves)})
        np.savez(os.path.join(tmp, "state.npz"), **arrays)  # type: ignore[arg-type]  # numpy's stub
        meta = {
            "round": r + 1,
            "structure": self.structure,
            "config": dataclasses.asdict(self.config),
            "ledger": self.ledger.state_dict(),
            "island_steps": {str(i): n for i, n in self._island_steps.items()},
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self._checkpoints()[:-CHECKPOINTS_KEPT]:
            shutil.rmtree(self._ckpt_dir(old), ignore_errors=True)

    def _checkpoints(self) -> list[int]:
        root = os.path.join(self.directory, "checkpoints")
        if not os.path.isdir(root):
            return []
        return sorted(
            int(n.split("-")[1])
            for n in os.listdir(root)
            if n.startswith("round-") and "." not in n
        )

    def _restore(self) -> int | None:
        rounds = self._checkpoints()
        if not rounds:
            return None
        r = rounds[-1]
        path = self._ckpt_dir(r)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if meta["structure"] != self.structure:
            raise ValueError(
                f"{path} holds a checkpoint of another model; nothing was restored.\n"
                f"  checkpoint: {meta['structure']}\n  this run:   {self.structure}\n"
                "Use another directory for another model."
            )
        saved = {k: v for k, v in meta["config"].items() if k in ("num_rows", "epochs", "seed")}
        mine = {k: getattr(self.config, k) for k in saved}
        if saved != mine:
            raise ValueError(
                f"{path} was written for the rows {saved}; this run has {mine}. The row ledger "
                "would not match: use another directory."
            )
        with np.load(os.path.join(path, "state.npz")) as z:
            self._params = [z[f"p{k}"] for k in range(len(self._params))]
            self._opt_leaves = [z[f"o{k}"] for k in range(len(self._opt_leaves))]
        self.ledger = RowLedger.from_state(meta["ledger"])
        self._island_steps = {int(i): int(n) for i, n in meta["island_steps"].items()}
        self.round = int(meta["round"])
        # Rows of rounds applied after this checkpoint belong to an abandoned timeline.
        for name in os.listdir(os.path.join(self.directory, "rows")):
            if name.startswith("round-") and int(name[6:13]) >= self.round:
                os.remove(os.path.join(self.directory, "rows", name))
        return self.round

    def _event(self, event: str, **fields: Any) -> None:
        line = {"event": event, "t": time.time(), "pid": os.getpid(), **fields}
        with open(os.path.join(self.directory, "events.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


def committed_rows(directory: str) -> np.ndarray:
    """Every position committed by the applied rounds kept in ``directory/rows``."""
    root = os.path.join(directory, "rows")
    names = sorted(n for n in os.listdir(root) if n.startswith("round-") and "tmp" not in n)
    parts = [np.load(os.path.join(root, n)) for n in names]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
