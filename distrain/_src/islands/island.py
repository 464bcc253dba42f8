"""One fault-isolated island: its training loop against the run's `IslandCoordinator`.

Every island runs :func:`train` in its own JAX world (one process or several, each with
any number of devices), usually started by ``distrain launch --islands N
--nproc-per-island P``. Per round it pulls the global parameters, leases rows, runs
``sync_every`` inner steps of the user's per-replica ``train_step`` with any synchronous
strategy over the island's devices, and submits its pseudo-gradient (global minus its
own parameters). A heartbeat thread keeps it alive in the coordinator's eyes. If the
island is declared dead, or the coordinator restarts, it joins again from the global
state; a restarted island does the same. With several processes, the island's process
0 alone talks to the coordinator and broadcasts to the others (``island_link.py``); the
loop itself is ``island_loop.py``.

The inner optimizer state across rounds: kept while the island lives (DiLoCo). When the
island joins or rejoins, it takes a live peer's (``heal_from_peer``) or the initial one,
and the step and every count optax keeps go on at ``round * sync_every``, so that
learning-rate schedules continue where its peers are (``joining.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from distrain._src.cluster.base import ENV_ISLAND, ENV_ISLANDS, ENV_NUM_PROCESSES
from distrain._src.goodput import ledger as goodput
from distrain._src.islands import remote
from distrain._src.islands.island_coordinator import IslandsConfig, structure_of
from distrain._src.islands.island_link import Link, rendezvous
from distrain._src.islands.island_loop import (
    IslandLoop,
    IslandsResult,
    Log,
    RoundHooks,
    SigTerm,
    Take,
)
from distrain._src.islands.joining import Joiner
from distrain._src.islands.outer import delayed_nesterov

__all__ = ["FaultIsolation", "IslandsResult", "random_access", "train"]


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


def _check_placement(strategy: Any, batch_size: int, rows: int) -> None:
    """Batches (the last, partial one too) that split over the island's replicas, and a
    strategy over the devices of every process of the island."""
    replicas = strategy.num_replicas_in_sync
    tail = rows % batch_size
    if batch_size % replicas or tail % replicas:
        raise ValueError(
            f"batch_size={batch_size} and the run's last, partial batch ({tail} rows: "
            f"the run's {rows} rows mod {batch_size}) must both split over the "
            f"island's {replicas} replicas. Choose a batch size (or epochs) for which they do."
        )
    processes = max(jax.process_count(), int(os.environ.get(ENV_NUM_PROCESSES, "1")))
    spanned = sorted({d.process_index for d in strategy.devices})
    if len(spanned) != processes:
        raise ValueError(
            f"the island has {processes} processes (--nproc-per-island), but its strategy "
            f"spans the devices of process(es) {spanned} of JAX's {jax.process_count()}. "
            "Expected a strategy over every device of the island: create "
            "dt.MultiWorkerMirroredStrategy() first thing in the program (before any other "
            "JAX call) and pass it as strategy=."
        )


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
    outer_dtype: str = "float32",
) -> IslandsResult:
    """Trains this island until every row of ``epochs`` passes was committed.

    Args:
      train_step: the per-replica step, ``(state, batch) -> (state, metrics)``.
      state: the initial train state (with ``params`` and ``replace``); every island
        must build the same one.
      data: a random-access dataset (see :func:`random_access`).
      batch_size: rows of one inner step of this island (split over its replicas).
      sync_every: H, inner steps per round.
      directory: the run's directory: the coordinator's checkpoints and events, each
        island's goodput ledger and timeline. A directory with a checkpoint resumes.
      epochs, seed: ``epochs`` passes over the rows, each in a permutation seeded by
        ``seed`` (``None``: in order).
      outer_optimizer: optax; default DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9), or
        with ``mode="async"`` delayed Nesterov with a delay of ``islands`` arrivals.
      strategy: the synchronous strategy over the island's devices (default
        ``dt.MirroredStrategy()``, or ``dt.MultiWorkerMirroredStrategy()`` in an island
        of several processes: create it first thing in the program).
      island, islands: this island's id and the number of islands (default: from
        ``distrain launch --islands``).
      min_islands: rounds pause below this many live islands.
      death_timeout, heartbeat_interval: an island without a heartbeat for
        ``death_timeout`` s is dead; it sends one every ``heartbeat_interval`` s.
      start_timeout: round 0 waits this long for every island to join.
      min_islands_timeout: the run fails after this long below ``min_islands``.
      mode: ``"sync"`` (rounds with a barrier) or ``"async"`` (each pseudo-gradient
        applied when it arrives).
      max_staleness: async: discard a pseudo-gradient computed from parameters more than
        this many outer updates old (its rows are trained again).
      round_timeout: an island that holds a lease this long without submitting is hung
        and treated as dead (``None``: ``IslandsConfig.round_timeout``); the survivors'
        wait is charged to their ledgers' ``hang`` bucket.
      call_timeout: seconds a call to the coordinator may take (its restart included).
      ray_address: the Ray cluster (default ``RAY_ADDRESS``, set by the launcher).
      on_round: called as ``on_round(round, global_params)`` before each round this
        island trains, and once with the final parameters; on every process.
      heal_from_peer: a (re)joining island starts from a live island's inner optimizer
        state (else the initial one; its counts go on at ``round x sync_every`` either
        way). Every island must then build the same optimizer (docs/islands.md).
      outer_dtype: what the pseudo-gradients travel to the shard holders as:
        ``"float32"``, ``"bfloat16"``, ``"int8"`` or ``"int4"`` (absmax per segment of
        a leaf; Streaming DiLoCo's codecs, ``docs/islands.md``).

    Returns:
      :class:`IslandsResult` (the final global parameters, on every process).

    Raises:
      TypeError: a dataset without random access.
      ValueError: a model other than the coordinator's; a bad configuration; a strategy
        that does not span the island's processes; healing from another optimizer.
      IslandsFailed: fewer than ``min_islands`` islands for ``min_islands_timeout`` s.

    Example::

        result = dt.experimental.islands.train(
            train_step, state, {"x": x, "y": y}, batch_size=32, sync_every=10,
            directory="runs/islands", epochs=2)
    """
    options = FaultIsolation(
        sync_every=sync_every, directory=directory, batch_size=batch_size, seed=seed,
        outer_optimizer=outer_optimizer, min_islands=min_islands, death_timeout=death_timeout,
        heartbeat_interval=heartbeat_interval, start_timeout=start_timeout,
        min_islands_timeout=min_islands_timeout, mode=mode, max_staleness=max_staleness,
        round_timeout=round_timeout, call_timeout=call_timeout, ray_address=ray_address,
        heal_from_peer=heal_from_peer, island=island, islands=islands, outer_dtype=outer_dtype,
    )  # fmt: skip
    return options.run(train_step, state, data, epochs=epochs, strategy=strategy,
                       on_round=on_round)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FaultIsolation:
    """Fault-isolated islands for ``dt.Trainer``: each island (a ``distrain launch
    --islands N`` process group) trains with the Trainer's strategy, step and callbacks,
    and syncs with the others every ``sync_every`` steps through the run's coordinator.

    The fields are :func:`train`'s arguments of the same names; ``batch_size`` defaults
    to the data's ``global_batch_size`` (a ``dt.data.ArrayPipeline``). In ``fit`` a
    callback's epoch is a round (``docs/islands.md``, "Through the Trainer").

    Example::

        trainer = dt.Trainer(strategy, train_step, eval_step, callbacks=[...],
                             islands=dt.experimental.islands.FaultIsolation(
                                 sync_every=10, directory="runs/islands"))
        state, history = trainer.fit(state, pipeline, epochs=2, validation_data=val)
    """

    sync_every: int
    directory: str
    batch_size: int | None = None
    seed: int | None = 0
    outer_optimizer: Any = None
    min_islands: int = 1
    death_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    start_timeout: float = 120.0
    min_islands_timeout: float = 300.0
    mode: str = "sync"
    max_staleness: int | None = None
    round_timeout: float | None = None
    call_timeout: float = 120.0
    ray_address: str | None = None
    heal_from_peer: bool = True
    island: int | None = None
    islands: int | None = None
    outer_dtype: str = "float32"

    def ids(self) -> tuple[int, int]:
        """``(island, islands)``: as given, else from ``distrain launch --islands``."""
        return _ids(self.island, self.islands)

    def run(
        self,
        train_step: Callable[..., Any],
        state: Any,
        data: Any,
        *,
        epochs: int = 1,
        strategy: Any = None,
        on_round: Callable[[int, Any], None] | None = None,
        hooks: RoundHooks | None = None,
        joiner_state: Any = None,
    ) -> IslandsResult:
        """Trains this island (:func:`train`); ``hooks`` hear of every round and step,
        and ``joiner_state`` (default ``state``) is the state the island (re)joins with
        when no live peer heals it (e.g. its own backup)."""
        island, islands = self.ids()
        num_rows, take = random_access(data)
        batch_size = self.batch_size or getattr(data, "global_batch_size", None)
        if batch_size is None:
            raise ValueError(
                "fault-isolated islands need the rows of one inner step: pass "
                "FaultIsolation(batch_size=...) or a dt.data.ArrayPipeline (its "
                f"global_batch_size). Received: {type(data).__name__} and batch_size=None."
            )
        # The coordinator's options are this object's fields of the same names.
        shared = {f.name for f in dataclasses.fields(IslandsConfig)} & set(vars(self))
        shared -= {"islands", "batch_size"}  # this run's: from the launcher and the data
        config = IslandsConfig(islands=islands, batch_size=batch_size, num_rows=num_rows,
                               epochs=epochs, **{k: getattr(self, k) for k in shared})  # fmt: skip
        options = dict(outer_optimizer=self.outer_optimizer, strategy=strategy,
                       call_timeout=self.call_timeout, ray_address=self.ray_address,
                       on_round=on_round, heal=self.heal_from_peer, hooks=hooks or RoundHooks(),
                       joiner_state=state if joiner_state is None else joiner_state)  # fmt: skip
        return _run(train_step, state, take, config, island, self.directory, **options)


def _run(
    train_step: Callable[..., Any],
    state: Any,
    take: Take,
    config: IslandsConfig,
    island: int,
    directory: str,
    *,
    outer_optimizer: Any,
    strategy: Any,
    call_timeout: float,
    ray_address: str | None,
    on_round: Callable[[int, Any], None] | None,
    heal: bool,
    hooks: RoundHooks,
    joiner_state: Any,
) -> IslandsResult:
    """:func:`train` once its arguments are checked: the strategy, the coordinator (from
    process 0), the link between the island's processes, then the loop."""
    import optax

    from distrain._src.islands.island_loop import host_leaves
    from distrain._src.islands.param_shards import check_elementwise
    from distrain._src.strategy.mirrored import MirroredStrategy
    from distrain._src.strategy.multi_worker import MultiWorkerMirroredStrategy

    if strategy is None:  # several processes: they joined with the user's (or any) one
        several = jax.process_count() > 1
        strategy = MultiWorkerMirroredStrategy() if several else MirroredStrategy()
    _check_placement(strategy, config.batch_size, config.num_rows * config.epochs)
    if outer_optimizer is None and config.mode == "async":
        outer_optimizer = delayed_nesterov(0.7, 0.9, delay=config.islands)
    outer_optimizer = outer_optimizer or optax.sgd(0.7, momentum=0.9, nesterov=True)
    check_elementwise(outer_optimizer)  # here, before the coordinator: one line, at once
    treedef = jax.tree.structure(state.params)
    leaves = host_leaves(state.params)
    structure = structure_of(leaves, str(treedef))
    leader, processes = jax.process_index() == 0, jax.process_count()
    rendezvous(processes)
    if leader:
        remote.connect(ray_address, config.islands)
    sigterm = SigTerm()  # after Ray's, which it replaces
    own_dir = os.path.join(directory, f"island-{island}")
    log = Log(own_dir, write=leader)
    joiner = Joiner(joiner_state, heal, config.sync_every, log)
    ledger = goodput.Ledger(own_dir, write=leader)
    goodput.set_current(ledger)
    log("start", island=island, pid=os.getpid(), processes=processes,
        process_start=goodput.process_start_time())  # fmt: skip
    coord = None
    if leader:
        # Absolute: the actor resolves the path where it runs, in another working directory.
        args = (config, leaves, str(treedef), outer_optimizer, os.path.abspath(directory))
        coord = remote.coordinator(remote.actor_name(directory), args, call_timeout)
        log("connected")
    opt_state = joiner.leaves if joiner.heal else None
    link = Link(coord, island, leaves, opt_state, config.lease_rows, processes, jax.process_index())
    stop = link.start_heartbeats(config.heartbeat_interval)
    loop = IslandLoop(
        link, strategy, train_step, take, joiner, ledger, log, batch_size=config.batch_size,
        treedef=treedef, structure=structure, directory=directory,
        until=call_timeout + config.min_islands_timeout, on_round=on_round, hooks=hooks,
        processes=processes, process=jax.process_index(), synchronous=config.mode == "sync",
    )  # fmt: skip
    sigterm.unwind = True
    try:
        return loop.run()
    finally:
        stop.set()
        goodput.set_current(None)
        ledger.close()
        sigterm.restore()
        if sigterm.received:
            sigterm.exit()
