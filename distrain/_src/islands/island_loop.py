"""One island's training loop, round by round, on each of the island's processes.

:func:`island.train` sets up; :class:`IslandLoop` runs: it joins (or rejoins) the run
and starts from the global parameters and a healed or fresh optimizer state
(:meth:`IslandLoop.join`), trains one round at a time (:meth:`IslandLoop.round`: the
lease, ``sync_every`` inner steps, the pseudo-gradient), and ends with the final global
parameters (:meth:`IslandLoop.finish`). Every exchange with the coordinator goes through
the island's :class:`~distrain._src.islands.island_link.Link`, so that the island's
processes agree on every round; each process trains its share of each batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from distrain._src.checkpoint.preemption import PREEMPTION_EXIT_CODE
from distrain._src.data.batches import check_dtypes
from distrain._src.data.placement import place_local
from distrain._src.islands.island_coordinator import RejoinRequired
from distrain._src.islands.island_link import Link
from distrain._src.islands.joining import Joiner
from distrain._src.train.metrics import Metric

Take = Callable[[np.ndarray], Any]


class RoundHooks:
    """What a caller of the loop (``dt.Trainer``'s islands ``fit``: its callbacks) is
    told, on every process of the island; the methods here do nothing."""

    def begin(self, r: int, params: Any) -> None:
        """Round ``r`` is about to train from the global ``params`` (a tree of arrays)."""

    def step(self, r: int, index: int, state: Any) -> None:
        """Inner step ``index`` (from 0) of round ``r`` returned ``state``."""

    def end(self, r: int, entry: dict[str, Any]) -> None:
        """Round ``r`` was submitted; ``entry`` is its line of ``IslandsResult.history``."""

    def retry(self, r: int) -> None:
        """Round ``r``, reported by :meth:`end`, was not applied: it is trained again."""


@dataclasses.dataclass(frozen=True)
class IslandsResult:
    """What :func:`island.train` returns on every process of every island.

    Attributes:
      params: the final global parameters (NumPy leaves in the state's structure).
      island: this island's id.
      history: one dict per round this process trained and submitted: ``round``,
        ``rows``, ``loss`` (the mean of the
        step metrics' ``"loss"``, if any), ``compute_s`` and ``applied`` (False: the
        asynchronous mode discarded it as too stale).
    """

    params: Any
    island: int
    history: list[dict[str, Any]]

    @property
    def rounds(self) -> int:
        """The rounds this process trained and submitted."""
        return len(self.history)


def host_leaves(tree: Any) -> list[np.ndarray]:
    """``tree``'s leaves as NumPy arrays on every process of the island: a replicated
    leaf from this process's copy; a leaf split over several processes gathered (a
    collective: every process calls this with the same tree)."""
    from jax.experimental import multihost_utils

    out = []
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                out.append(np.asarray(x.addressable_data(0)))
            else:
                out.append(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
        else:
            out.append(np.asarray(jax.device_get(x)))
    return out


def _delta(global_leaf: np.ndarray, local: np.ndarray) -> np.ndarray:
    dtype = np.promote_types(global_leaf.dtype, np.float32)
    return global_leaf.astype(dtype) - local.astype(dtype)


def _round_loss(losses: list[Any]) -> float | None:
    """The round's loss: the merged sums' value for ``dt.metrics``, else the mean."""
    if not losses:
        return None
    if isinstance(losses[0], Metric):
        return float(functools.reduce(lambda a, b: a.merge(b), losses).compute())
    return float(np.mean(losses))


class Log:
    """``DIR/island-I/timeline.jsonl``: start-up milestones and one line per round,
    written by the island's process 0 (the others' calls do nothing)."""

    def __init__(self, directory: str, write: bool = True) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "timeline.jsonl")
        self.write = write

    def __call__(self, event: str, **fields: Any) -> None:
        if self.write:
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


class _Terminated(BaseException):
    """SIGTERM reached the island inside its loop, which unwinds."""


class SigTerm:
    """SIGTERM ends an island at once with ``PREEMPTION_EXIT_CODE`` (143).

    What the island knows lives in the coordinator (committed each round), so there is
    nothing to save: ``distrain launch`` restarts it as a preemption, or, when the
    launcher itself was stopped (Ctrl-C), the island is gone well within its grace
    period. Inside the loop (``unwind``) the handler raises, so that :func:`train`'s
    ``finally`` closes the ledger, and then ends the process; before it, the handler
    ends it at once. Replaced: Ray's own handler (``sys.exit(15)``: a failure, after
    2-4 s of interpreter shutdown) and the C-level one Ray's core worker installs over
    it, which printed a stack trace of the SIGTERM. Only on the main thread (where
    Python sets handlers). Not `checkpoint.preemption.PreemptionHandler`: it saves, then
    exits with ``SystemExit``, which Ray's ``get`` turns into a failure.
    """

    def __init__(self) -> None:
        self.received = False
        self.unwind = False
        self.previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        if not self.unwind:
            self.exit()
        raise _Terminated  # inside ray.get it comes out as a SystemError: see `received`

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)

    @staticmethod
    def exit() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PREEMPTION_EXIT_CODE)


@dataclasses.dataclass
class IslandLoop:
    """The rounds of one island on one of its processes (see the module's docstring).

    Example (in :func:`island.train`)::

        loop = IslandLoop(link, strategy, train_step, take, joiner, ledger, log,
                          batch_size=B, treedef=treedef, structure=structure,
                          directory=d, until=420.0)
        result = loop.run()
    """

    link: Link
    strategy: Any
    train_step: Callable[..., Any]
    take: Take
    joiner: Joiner
    ledger: Any  # goodput.Ledger
    log: Log
    batch_size: int
    treedef: Any
    structure: str  # the parameters' (`structure_of`), checked by the coordinator
    directory: str
    until: float  # how long a polled call may go unanswered
    on_round: Callable[[int, Any], None] | None = None
    hooks: RoundHooks = dataclasses.field(default_factory=RoundHooks)
    processes: int = 1
    process: int = 0
    synchronous: bool = True  # rounds advance together (else asynchronous islands)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    done: int = 0  # inner steps of this island, its earlier incarnations' applied ones too
    placed: Any = None  # the island's state on its devices; None until (re)joined
    joined: bool = False
    first_step: bool = True

    def to_tree(self, leaves: list[np.ndarray]) -> Any:
        return jax.tree.unflatten(self.treedef, leaves)

    def run(self) -> IslandsResult:
        """Trains until every row was committed; returns the final global parameters."""
        after, r = -1, 0
        leaves: list[np.ndarray] = []
        while True:
            try:
                if not self.joined:
                    with self.ledger.phase("sync"):
                        joiner = self.joiner
                        steps = self.link.join(self.structure, joiner.structure, joiner.heal)
                    self.joined, self.placed, after = True, None, -1
                    self.log("joined")
                    # Steps of earlier incarnations whose round was not applied are lost.
                    self.ledger.resumed(steps)
                with self.ledger.phase("sync"):
                    r, leaves, finished, hang_s, donate = self.link.wait_round(after, self.until)
                # Part of that barrier wait was for a peer found hung (the round deadline).
                self.ledger.move(hang_s, "sync", "hang")
                if finished:
                    break
                if self.synchronous and r == after:  # not applied (a holder lost it): again
                    self.retry(r)
                if self.on_round is not None:
                    self.on_round(r, self.to_tree(leaves))
                self.hooks.begin(r, self.to_tree(leaves))
                self.start(r, leaves, donate)
                self.round(r, leaves)
                after = r
            except RejoinRequired as e:
                self.log("rejoin", why=str(e))
                self.joined = False
                self.link.token = None
        return self.finish(r, leaves)

    def retry(self, r: int) -> None:
        """Round ``r``, which this island submitted, was not applied (a shard holder
        restarted and lost a pseudo-gradient of it): its steps no longer count as applied,
        and the island trains the round again from the same global parameters."""
        entry = self.history[-1]
        entry["applied"] = False
        self.done -= -(-entry["rows"] // self.batch_size)
        self.log("retry", round=r)
        self.hooks.retry(r)

    def start(self, r: int, leaves: list[np.ndarray], donate: bool) -> None:
        """The state round ``r`` starts from: after a (re)join the joiner's (healed or
        fresh), else the island's own with the global parameters; and this round's
        donation to a joiner, when the coordinator asks for one."""
        if self.placed is None:  # a (re)join
            if self.first_step and r and self.link.leader:  # joins a run under way: say where
                print(f"island {self.link.island}: continuing the run in {self.directory} "
                      f"at round {r}")  # fmt: skip
            island, joiner = self.link.island, self.joiner
            with self.ledger.phase("sync"):
                t0 = time.time()
                check = functools.partial(joiner.check, island=island)
                healing = self.link.take_state(r, self.until, check) if joiner.heal else None
                joined = joiner.begin(healing, island, r, self.to_tree(leaves), time.time() - t0)
            self.placed = self.strategy.put_replicated(joined)
        else:
            params = self.strategy.put_replicated(self.to_tree(leaves))
            self.placed = self.placed.replace(params=params)
        if donate:  # a joiner waits for a trained optimizer state: this round's
            with self.ledger.phase("sync"):
                self.link.donate(r, self.joiner.donation(self.placed, host_leaves))

    def batch(self, rows: np.ndarray) -> Any:
        """One global batch of ``rows`` on the island's devices; with several processes
        each takes only its own share of the rows (the ``p``-th contiguous block: the
        strategy's replicas are in process order)."""
        if self.processes == 1:
            return self.strategy.distribute_batch(self.take(rows))
        share = len(rows) // self.processes
        mine = rows[self.process * share : (self.process + 1) * share]
        leaves, treedef = jax.tree.flatten(self.take(mine))
        check_dtypes(leaves, treedef)
        return place_local(self.strategy, leaves, treedef, share)

    def steps(self, r: int, rows: np.ndarray) -> list[Any]:
        """The round's inner steps over ``rows``; returns their reduced losses."""
        losses = []
        for k in range(0, len(rows), self.batch_size):
            with self.ledger.phase("input"):
                batch = self.batch(rows[k : k + self.batch_size])
            with self.ledger.phase("step"):
                self.placed, metrics = self.strategy.run(self.train_step, args=(self.placed, batch))
                if self.first_step:
                    jax.block_until_ready(self.placed)
                    self.log("first_step", round=r)
                    self.first_step = False
            if isinstance(metrics, Mapping) and "loss" in metrics:
                loss = metrics["loss"]  # an array per replica, or a dt.metrics sum
                op = "sum" if isinstance(loss, Metric) else "mean"
                losses.append(self.strategy.reduce(op, loss))
            self.done += 1
            self.ledger.progress(self.done)
            self.hooks.step(r, k // self.batch_size, self.placed)
        return losses

    def round(self, r: int, global_leaves: list[np.ndarray]) -> None:
        """Round ``r``: lease, train, submit the pseudo-gradient (global minus the
        island's parameters: they are replicated over the island, so process 0's copy is
        the island's)."""
        with self.ledger.phase("sync"):
            rows = self.link.lease(r, self.until)
        t0 = time.time()
        losses = self.steps(r, rows)
        with self.ledger.phase("step"):
            local = host_leaves(self.placed.params)
            loss = _round_loss([self.to_loss(x) for x in losses])
        compute = time.time() - t0
        grads = (  # outer.pseudo_gradient's, on the host: float32 or wider
            [_delta(g, x) for g, x in zip(global_leaves, local, strict=True)]
            if len(rows) and self.link.leader
            else None
        )
        t1 = time.time()
        with self.ledger.phase("sync"):
            applied = self.link.submit(r, grads, {"loss": loss or 0.0, "compute_s": compute})
        entry = {"round": r, "rows": len(rows), "loss": loss, "compute_s": compute,
                 "applied": applied}  # fmt: skip
        self.history.append(entry)
        self.log("round", round=r, applied=applied, rows=len(rows), loss=loss,
                 compute_s=compute, submit_s=time.time() - t1)  # fmt: skip
        self.hooks.end(r, entry)

    def to_loss(self, value: Any) -> Any:
        """A reduced loss on the host (a replicated array, or a ``dt.metrics`` sum)."""
        leaves, treedef = jax.tree.flatten(value)
        return jax.tree.unflatten(treedef, host_leaves(leaves))

    def finish(self, r: int, leaves: list[np.ndarray]) -> IslandsResult:
        """The run is over: the final global parameters; the island leaves."""
        final = self.to_tree(leaves)
        if self.on_round is not None:
            self.on_round(r, final)
        self.link.leave()
        self.ledger.finished()
        self.log("finished", rounds=len(self.history))
        return IslandsResult(params=final, island=self.link.island, history=self.history)
