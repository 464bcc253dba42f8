"""One fault-isolated island: its training loop against the run's `IslandCoordinator`.

Every island runs :func:`train` in its own JAX world (one process, with any number of
devices), usually started by ``distrain launch --islands N``. Per
round it pulls the global parameters, leases rows, runs ``sync_every`` inner steps of
the user's per-replica ``train_step`` with any synchronous strategy, and submits its
pseudo-gradient (global minus its own parameters). A heartbeat thread keeps it alive in
the coordinator's eyes. If the island is declared dead, or the coordinator restarts, it
joins again from the global state; a restarted island process does the same.

The inner optimizer state across rounds: kept while the island lives (DiLoCo). When the
island joins or rejoins, it takes a live peer's (``heal_from_peer``) or the initial one,
and the step and every count optax keeps go on at ``round * sync_every``, so that
learning-rate schedules continue where its peers are (``joining.py``).
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
from distrain._src.cluster.base import ENV_ISLAND, ENV_ISLANDS, ENV_NUM_PROCESSES
from distrain._src.goodput import ledger as goodput
from distrain._src.islands import remote
from distrain._src.islands.island_coordinator import IslandsConfig, RejoinRequired, structure_of
from distrain._src.islands.joining import Joiner
from distrain._src.islands.outer import delayed_nesterov
from distrain._src.train.metrics import Metric

Take = Callable[[np.ndarray], Any]


@dataclasses.dataclass(frozen=True)
class IslandsResult:
    """What :func:`train` returns on every island.

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


def random_access(data: Any) -> tuple[int, Take]:
    """``(rows, take)`` for a dataset the coordinator can hand out row by row.

    Accepted: a dict, tuple or list of arrays with a common leading axis, one array, an
    ``ArrayPipeline``, or a random-access source (``__len__`` and ``__getitem__``, e.g.
    grain's ``RandomAccessDataSource``; its records are stacked).

    Raises:
      TypeError: anything else (an iterator, a generator, a ``tf.data`` or grain
        ``IterDataset``): the coordinator could not give a dead island's rows to another.
    """
    from distrain._src.data.pipeline import ArrayPipeline

    if isinstance(data, ArrayPipeline):
        return data.num_examples, data.take
    if isinstance(data, np.ndarray | jax.Array):
        arr = np.asarray(data)
        return len(arr), lambda idx: arr[idx]
    if isinstance(data, Mapping | tuple | list) and data:
        leaves = jax.tree.leaves(data)
        if leaves and all(hasattr(x, "shape") and np.ndim(x) >= 1 for x in leaves):
            lengths = {int(np.shape(x)[0]) for x in leaves}
            if len(lengths) != 1:
                raise ValueError(
                    f"the dataset's arrays have different lengths {sorted(lengths)}; expected "
                    "one leading (row) axis shared by every array."
                )
            host = jax.tree.map(np.asarray, data)
            return lengths.pop(), lambda idx: jax.tree.map(lambda x: x[idx], host)
    if (
        hasattr(data, "__len__")
        and hasattr(data, "__getitem__")
        and not hasattr(data, "__next__")
        and not isinstance(data, str | bytes | Mapping | tuple | list)
    ):

        def take(idx: np.ndarray) -> Any:
            records = [data[int(i)] for i in idx]
            return jax.tree.map(lambda *xs: np.stack(xs), *records)

        return len(data), take
    raise TypeError(
        "fault-isolated islands need a random-access dataset: the coordinator hands out "
        "rows by index, and gives a dead island's rows to another. Expected a dict, tuple "
        "or list of arrays, an array, a dt.data.ArrayPipeline, or a source with __len__ and "
        f"__getitem__ (grain's RandomAccessDataSource). Received: {type(data).__name__}."
    )


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


def _ids(island: int | None, islands: int | None) -> tuple[int, int]:
    def env(name: str) -> int | None:
        value = os.environ.get(name)
        return None if value is None else int(value)

    island = env(ENV_ISLAND) if island is None else island
    islands = env(ENV_ISLANDS) if islands is None else islands
    if island is None or islands is None:
        raise ValueError(
            "islands.train needs this island's id and the number of islands: pass island= "
            f"and islands=, or start it with `distrain launch --islands N` (which sets "
            f"{ENV_ISLAND} and {ENV_ISLANDS}). Received: island={island}, "
            f"islands={islands}."
        )
    if not 0 <= island < islands:
        raise ValueError(f"island={island} is not one of islands={islands} (0..{islands - 1}).")
    return island, islands


def _check_placement(replicas: int, batch_size: int, rows: int) -> None:
    """One process per island, and batches (the last, partial one too) that split over
    the island's replicas."""
    tail = rows % batch_size
    if batch_size % replicas or tail % replicas:
        raise ValueError(
            f"batch_size={batch_size} and the run's last, partial batch ({tail} rows: "
            f"the run's {rows} rows mod {batch_size}) must both split over the "
            f"island's {replicas} replicas. Choose a batch size (or epochs) for which they do."
        )
    processes = max(jax.process_count(), int(os.environ.get(ENV_NUM_PROCESSES, "1")))
    if processes > 1:
        raise ValueError(
            f"islands.train runs one process per island in this release; this island has "
            f"{processes} processes. Use --nproc-per-island 1 (each process may "
            "hold several devices: --devices-per-proc, or the GPUs it sees)."
        )


class _Log:
    """``DIR/island-I/timeline.jsonl``: start-up milestones and one line per round."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "timeline.jsonl")

    def __call__(self, event: str, **fields: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


class _Terminated(BaseException):
    """SIGTERM reached the island inside :func:`train`'s loop, which unwinds."""


class _SigTerm:
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


def train(
    train_step: Callable[..., Any],
    state: Any,
    data: Any,
    *,
    batch_size: int,
    sync_every: int,
    directory: str,
    epochs: int = 1,
    seed: int | None = 0,
    outer_optimizer: Any = None,
    strategy: Any = None,
    island: int | None = None,
    islands: int | None = None,
    min_islands: int = 1,
    death_timeout: float = 10.0,
    heartbeat_interval: float = 1.0,
    start_timeout: float = 120.0,
    min_islands_timeout: float = 300.0,
    mode: str = "sync",
    max_staleness: int | None = None,
    round_timeout: float | None = None,
    call_timeout: float = 120.0,
    ray_address: str | None = None,
    on_round: Callable[[int, Any], None] | None = None,
    heal_from_peer: bool = True,
) -> IslandsResult:
    """Trains this island until every row of ``epochs`` passes was committed.

    Args:
      train_step: the per-replica step, ``(state, batch) -> (state, metrics)``, as for
        ``strategy.run``.
      state: the initial train state (a ``dt.TrainState`` or any state with ``params``
        and ``replace``); every island must build the same one.
      data: a random-access dataset (see :func:`random_access`).
      batch_size: rows of one inner step of this island (split over its replicas).
      sync_every: H, inner steps per round.
      directory: the run's directory: the coordinator's checkpoints and events, each
        island's goodput ledger and timeline. A directory with a checkpoint resumes.
      epochs, seed: the rows handed out: ``epochs`` passes, each in a permutation seeded
        by ``seed`` (``None``: in order).
      outer_optimizer: optax; default DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9), or
        with ``mode="async"`` delayed Nesterov with the same constants and a delay of
        ``islands`` arrivals.
      strategy: the synchronous strategy inside the island (default
        ``dt.MirroredStrategy()`` over this process's devices).
      island, islands: this island's id and the number of islands (default: from
        ``distrain launch --islands``).
      min_islands: rounds pause below this many live islands.
      death_timeout, heartbeat_interval: an island without a heartbeat for
        ``death_timeout`` s is dead; it sends one every ``heartbeat_interval`` s.
      start_timeout: round 0 waits this long for every island to join.
      min_islands_timeout: the run fails after this long below ``min_islands``.
      mode: ``"sync"`` (rounds with a barrier) or ``"async"`` (each pseudo-gradient
        applied when it arrives; no island waits for another).
      max_staleness: async: discard a pseudo-gradient computed from parameters more than
        this many outer updates old (its rows are trained again).
      round_timeout: an island that holds a lease this long without submitting (or, in
        a synchronous round, has not leased this long after the round started) is hung
        and treated as dead; ``None``: 5 x the median round time, at least 60 s
        (``IslandsConfig.round_timeout``). The survivors' wait for it is charged to the
        ``hang`` bucket of their goodput ledgers.
      call_timeout: seconds a call to the coordinator may take (its restart included).
      ray_address: the Ray cluster (default ``RAY_ADDRESS``, set by the launcher).
      on_round: called as ``on_round(round, global_params)`` before each round this
        island trains, and once with the final parameters (e.g. to evaluate them).
      heal_from_peer: when this island (re)joins a run under way, start from a live
        island's inner optimizer state instead of the initial one (torchft's healing;
        its counts go on at ``round x sync_every`` either way; on by default: it
        measured a smaller killed-vs-unkilled loss gap at no slower a rejoin, see
        docs/islands.md). Every island must then build the same optimizer. Without a
        live peer that trained a round, it starts as without healing and says so in one
        line.

    Returns:
      :class:`IslandsResult` (the final global parameters on every island).

    Raises:
      TypeError: a dataset without random access.
      ValueError: a model other than the coordinator's; a bad configuration; healing
        from a peer whose optimizer state differs in structure.
      IslandsFailed: fewer than ``min_islands`` islands for ``min_islands_timeout`` s.

    Example::

        result = dt.experimental.islands.train(
            train_step, state, {"x": x, "y": y}, batch_size=32, sync_every=10,
            directory="runs/islands", epochs=2)
    """
    import optax

    from distrain._src.strategy.mirrored import MirroredStrategy

    island, islands = _ids(island, islands)
    num_rows, take = random_access(data)
    config = IslandsConfig(
        islands=islands,
        sync_every=sync_every,
        batch_size=batch_size,
        num_rows=num_rows,
        epochs=epochs,
        seed=seed,
        min_islands=min_islands,
        death_timeout=death_timeout,
        heartbeat_interval=heartbeat_interval,
        start_timeout=start_timeout,
        min_islands_timeout=min_islands_timeout,
        mode=mode,
        max_staleness=max_staleness,
        round_timeout=round_timeout,
    )
    strategy = strategy or MirroredStrategy()
    _check_placement(strategy.num_replicas_in_sync, batch_size, num_rows * epochs)
    if outer_optimizer is None and mode == "async":
        outer_optimizer = delayed_nesterov(0.7, 0.9, delay=islands)
    outer_optimizer = outer_optimizer or optax.sgd(0.7, momentum=0.9, nesterov=True)
    host_params = jax.device_get(state.params)
    leaves, treedef = jax.tree.flatten(host_params)
    leaves = [np.asarray(x) for x in leaves]
    structure = structure_of(leaves, str(treedef))
    remote.connect(ray_address, islands)
    sigterm = _SigTerm()  # after Ray's, which it replaces
    own_dir = os.path.join(directory, f"island-{island}")
    log = _Log(own_dir)
    joiner = Joiner(state, heal_from_peer, sync_every, log)
    ledger = goodput.Ledger(own_dir)
    goodput.set_current(ledger)
    log("start", island=island, pid=os.getpid(), process_start=goodput.process_start_time())

    name = remote.actor_name(directory)
    # Absolute: the actor resolves the path where it runs, in another working directory.
    args = (config, leaves, str(treedef), outer_optimizer, os.path.abspath(directory))
    coord = remote.coordinator(name, args, call_timeout)
    log("connected")

    token: list[str] = []  # the live token, read by the heartbeat thread
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_interval):
            if token:
                try:
                    coord("heartbeat", island, token[-1])
                except Exception:  # a rejoin or a restart is handled by the loop
                    pass

    threading.Thread(target=beat, daemon=True, name=f"island-{island}-heartbeat").start()

    def to_tree(flat: list[np.ndarray]) -> Any:
        return jax.tree.unflatten(treedef, flat)

    history: list[dict[str, Any]] = []
    done = 0  # inner steps of this island, its earlier incarnations' applied ones included
    first_step = True
    placed = None
    after = -1
    sigterm.unwind = True
    try:
        while True:
            try:
                if not token:
                    with ledger.phase("sync"):
                        new, done = coord.retry(
                            lambda: coord("join", island, structure, joiner.structure, joiner.heal)
                        )
                    token.append(new)
                    log("joined")
                    # Steps of earlier incarnations whose round was not applied are lost.
                    ledger.resumed(done)
                    placed, after = None, -1
                until = call_timeout + min_islands_timeout
                with ledger.phase("sync"):
                    r, global_leaves, finished, hang_s, donate = coord.poll(
                        "wait_round", island, token[-1], after, until=until
                    )
                # Part of that barrier wait was for a peer found hung (the round deadline).
                ledger.move(hang_s, "sync", "hang")
                if finished:
                    break
                if on_round is not None:
                    on_round(r, to_tree(global_leaves))
                if placed is None:  # a (re)join
                    if first_step and r:  # this process joins a run under way: say where
                        print(f"island {island}: continuing the run in {directory} at round {r}")
                    with ledger.phase("sync"):
                        joined = joiner.start(
                            coord, island, token[-1], r, to_tree(global_leaves), until
                        )
                    placed = strategy.put_replicated(joined)
                else:
                    placed = placed.replace(params=strategy.put_replicated(to_tree(global_leaves)))
                if donate:  # a joiner waits for a trained optimizer state: this round's
                    with ledger.phase("sync"):
                        coord("donate", island, token[-1], r, joiner.donation(placed))
                with ledger.phase("sync"):
                    _positions, rows = coord.poll("lease", island, token[-1], r, until=until)
                t0 = time.time()
                losses = []
                for k in range(0, len(rows), batch_size):
                    with ledger.phase("input"):
                        batch = strategy.distribute_batch(take(rows[k : k + batch_size]))
                    with ledger.phase("step"):
                        placed, metrics = strategy.run(train_step, args=(placed, batch))
                        if first_step:
                            jax.block_until_ready(placed)
                            log("first_step", round=r)
                            first_step = False
                    if isinstance(metrics, Mapping) and "loss" in metrics:
                        loss = metrics["loss"]  # an array per replica, or a dt.metrics sum
                        op = "sum" if isinstance(loss, Metric) else "mean"
                        losses.append(strategy.reduce(op, loss))
                    done += 1
                    ledger.progress(done)
                with ledger.phase("step"):
                    local = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(placed.params))]
                    loss = _round_loss(jax.device_get(losses))
                compute = time.time() - t0
                grads = (  # outer.pseudo_gradient's, on the host: float32 or wider
                    [_delta(g, x) for g, x in zip(global_leaves, local, strict=True)]
                    if len(rows)
                    else None
                )
                t1 = time.time()
                with ledger.phase("sync"):
                    applied = coord(
                        "submit",
                        island,
                        token[-1],
                        r,
                        grads,
                        {"loss": loss or 0.0, "compute_s": compute},
                    )
                history.append(
                    {"round": r, "rows": len(rows), "loss": loss, "compute_s": compute,
                     "applied": applied}
                )  # fmt: skip
                log(
                    "round",
                    round=r,
                    applied=applied,
                    rows=len(rows),
                    loss=loss,
                    compute_s=compute,
                    submit_s=time.time() - t1,
                )
                after = r
            except RejoinRequired as e:
                log("rejoin", why=str(e))
                token.clear()
        final = to_tree(global_leaves)
        if on_round is not None:
            on_round(r, final)
        stop.set()
        if coord("leave", island, token[-1]):  # the last island out ends the coordinator
            coord.kill()
        ledger.finished()
        log("finished", rounds=len(history))
        return IslandsResult(params=final, island=island, history=history)
    finally:
        stop.set()
        goodput.set_current(None)
        ledger.close()
        sigterm.restore()
        if sigterm.received:
            sigterm.exit()
