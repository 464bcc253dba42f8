"""``DiLoCoStrategy``: islands of replicas that train apart for H steps, then meet.

The mesh is ``("island", "replica", *inner)``: ``MirroredStrategy``'s mesh with an outer
axis of islands (``Strategy``'s replica groups). ``run`` compiles one program, manual
over the islands and the replicas, in which

1. each replica runs the user's ``train_step`` on its island's state (no island axis):
   the replica context is the island's (its ``num_replicas_in_sync``, ``all_reduce``,
   the gradient sum of ``apply_gradients`` and ``compute_average_loss``'s global batch),
   so an inner step has no collective across islands;
2. then :func:`outer.after_inner_step` counts the step and, after the H-th, runs the
   outer step: the islands' mean of ``global - island`` crosses islands once per island
   (``outer_sync.py``), the outer optimizer steps the global parameters, the islands
   merge with them.

The state is a :class:`outer.DiLoCoState`: the global parameters and the outer
optimizer states (placed like ``MirroredStrategy``'s state), the islands' states with a
leading island axis split over ``"island"``, and the counters, all array leaves.

Example:
  >>> strategy = dt.experimental.DiLoCoStrategy(islands=4, sync_every=50,
  ...     outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
  >>> state = strategy.put_replicated(train_state)           # a DiLoCoState
  >>> state, loss = strategy.run(train_step, args=(state, batch))
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from distrain._src import context
from distrain._src.cluster.base import ClusterResolver
from distrain._src.cluster.resolve import resolve_cluster
from distrain._src.cluster.runtime import initialize_distributed
from distrain._src.cross_device_ops import CrossDeviceOps
from distrain._src.islands import outer
from distrain._src.islands.codecs import OuterDType
from distrain._src.islands.outer import DiLoCoState
from distrain._src.islands.outer_sync import ISLAND_AXIS, OuterSync, check_outer_sync, exchange
from distrain._src.islands.schedule import DiLoCoConfig
from distrain._src.strategy import _checks
from distrain._src.strategy import layout as _layout
from distrain._src.strategy.base import Strategy
from distrain._src.strategy.devices import DeviceSpec, parse_devices
from distrain._src.strategy.replica_layout import is_abstract
from distrain._src.strategy.replica_mesh import DevicesPerReplica
from distrain._src.strategy.rules import LayoutRules, LogicalAxisRules
from distrain._src.strategy.sharded import DEFAULT_MIN_SHARD_BYTES
from distrain._src.values import PerGroup, PerReplica


def _is_state(x: Any) -> bool:
    return isinstance(x, DiLoCoState)


@final
class DiLoCoStrategy(Strategy):
    """DiLoCo and Streaming DiLoCo: ``islands`` groups of replicas, an outer step every
    ``sync_every`` inner steps (``docs/islands.md``).

    Inside an island everything is ``MirroredStrategy`` (replicas that span devices,
    named inner axes, layouts); across islands only the outer step communicates. On the
    CPU backend ``run`` (and so ``Trainer.fit``) keeps one step in flight, not two: the
    host dispatches a step once the one before it is done (XLA:CPU aborted in the outer
    all-reduce with two in flight).

    Args:
      islands: the number of islands, equal groups of the devices in order.
      sync_every: ``H``, inner steps (calls of the user's step) per round.
      outer_optimizer: the optax transformation of the global parameters, the
        pseudo-gradient (global minus the islands' mean) as gradient; DiLoCo's is
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      fragments: Streaming DiLoCo's ``F``: an int (contiguous groups of parameter leaves)
        or a list of path patterns; fragment ``f`` syncs after steps ``s`` with
        ``s % H == (f + 1) * H / F % H``.
      fragment_sync_delay: ``d``, a delayed application: a fragment's pseudo-gradient
        is taken and exchanged after step ``s - d`` (its collective runs inside that
        step's program, synchronously) and applied after step ``s``. Nothing overlaps
        the exchange yet: that needs a backend whose collectives XLA runs asynchronously
        (GPU) and a collective started in one step and finished in another.
      fragment_update_alpha: ``α`` in [0, 1]: after a sync each island keeps
        ``α·local + (1 - α)·global`` (0: the global parameters exactly).
      outer_dtype: what each island sends: ``"float32"``, ``"bfloat16"``, ``"int8"`` or
        ``"int4"`` (absmax per tensor, two values per byte); decoded and averaged in
        float32.
      outer_sync: ``"hierarchical"``: each replica sends its 1/R share of its island's
        outer gradient (or encoding) across islands, one copy per island crosses;
        ``"flat"``: every replica sends all of it (R copies). The same values.
      devices: the devices, in island order (default: every device of every process,
        after joining the cluster ``cluster_resolver`` or the environment describes, as
        ``dt.MultiWorkerMirroredStrategy`` does).
      cluster_resolver: the processes (default ``dt.resolve_cluster()``); with several,
        each island is whole processes or part of one.
      cross_device_ops, devices_per_replica, layout, logical_axis_rules, batch_layout,
        min_shard_bytes: as ``dt.MirroredStrategy``'s, inside each island.

    Raises:
      ValueError: ``islands`` not a positive int dividing the devices (or the replicas),
        islands that cut processes unevenly, an inner axis named ``"island"``, and the
        configuration errors of ``sync_every``, ``fragments``, ``fragment_sync_delay``,
        ``fragment_update_alpha``, ``outer_dtype`` and ``outer_sync``.
      TypeError: ``outer_optimizer`` is not an optax transformation.

    Example:
      >>> strategy = dt.experimental.DiLoCoStrategy(islands=2, sync_every=10,
      ...     outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
      >>> strategy.num_replicas_in_sync, strategy.replicas_per_island      # 8 devices
      (8, 4)
    """

    island_axis = ISLAND_AXIS

    def __init__(
        self,
        islands: int,
        sync_every: int,
        outer_optimizer: optax.GradientTransformation,
        *,
        fragments: int | Sequence[str] = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        outer_dtype: OuterDType = "float32",
        outer_sync: OuterSync = "hierarchical",
        devices: Sequence[DeviceSpec] | None = None,
        cluster_resolver: ClusterResolver | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        devices_per_replica: DevicesPerReplica = 1,
        layout: LayoutRules | None = None,
        logical_axis_rules: LogicalAxisRules | None = None,
        batch_layout: LayoutRules | None = None,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    ) -> None:
        # Everything is checked before a device is touched.
        self._config = DiLoCoConfig(
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            fragments=fragments if isinstance(fragments, int) else tuple(fragments),
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            outer_dtype=outer_dtype,
        )
        self._outer_sync = check_outer_sync(outer_sync)
        if devices is None:
            # Every device of every process, processes in order (each island whole
            # processes or part of one); joins the cluster the environment describes.
            resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
            if cluster_resolver is not None or resolver.num_processes > 1:
                initialize_distributed(resolver)
            found = tuple(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        else:
            found = tuple(parse_devices(devices))
        _check_islands(islands, found, devices_per_replica)
        self._islands = islands
        super().__init__(
            found,
            cross_device_ops,
            # XLA:CPU aborted the process in the islands' outer all-reduce with two steps
            # in flight, under load ("Expected 4 threads to join the rendezvous, but only 3
            # of them arrived"): on CPU a step is dispatched once the one before it is done.
            max_in_flight=1 if all(d.platform == "cpu" for d in found) else 2,
            devices_per_replica=devices_per_replica,
            layout=layout,
            logical_axis_rules=logical_axis_rules,
            batch_layout=batch_layout,
            min_shard_bytes=min_shard_bytes,
            replica_groups=(ISLAND_AXIS, islands),
        )
        # Per user function: what the compiler runs, and the Trainer's inner step.
        self._steps: dict[Any, Callable[..., Any]] = {}
        self._train_steps: dict[Any, Callable[..., Any]] = {}

    # ------------------------------------------------------------------ basics
    @property
    def islands(self) -> int:
        """The number of islands."""
        return self._islands

    @property
    def replicas_per_island(self) -> int:
        """The replicas of one island: ``num_replicas_in_sync`` inside a step."""
        return self.num_replicas_in_sync // self._islands

    @property
    def outer_sync(self) -> OuterSync:
        """How the outer step crosses islands: ``"hierarchical"`` or ``"flat"``."""
        return self._outer_sync

    @property
    def config(self) -> DiLoCoConfig:
        """The validated outer-step configuration (``sync_every``, fragments, ...)."""
        return self._config

    def island_of(self, replica_id: int) -> int:
        """The island of replica ``replica_id`` (replicas are numbered island by island)."""
        return replica_id // self.replicas_per_island

    def __repr__(self) -> str:
        return (
            f"DiLoCoStrategy(islands={self._islands}, sync_every={self._config.sync_every}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )

    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        return self._placement.state_sharding(shape, path)

    def island_sharding(self, shape: tuple[int, ...], path: str = "") -> NamedSharding:
        """Where an island-varying leaf of ``shape`` (island axis first) lives: one row
        per island, laid out inside each island as ``state_sharding`` lays out a row."""
        return self._placement.group_sharding(shape, path)

    # --------------------------------------------------------------- placement
    def put_replicated(self, tree: Any) -> DiLoCoState:
        """The :class:`DiLoCoState` of a train state: every island a copy of ``tree``,
        the global parameters its ``params``; placed (a ``DiLoCoState`` is placed again
        only where a leaf is not on this strategy's devices).

        Raises:
          TypeError: a leaf that is not an array or a number; parameters that are not
            floating point; a state without ``params``.
        """
        if isinstance(tree, DiLoCoState):
            return self._place(tree)
        shapes_only = is_abstract(tree)
        if not shapes_only:
            tree = _checks.check_placeable(tree)
        if not hasattr(tree, "params") or not hasattr(tree, "replace"):
            raise TypeError(
                "DiLoCoStrategy.put_replicated takes a train state with `params` and "
                "`replace` (dt.TrainState, flax's TrainState) or a DiLoCoState. Received: "
                f"{type(tree).__name__}."
            )
        self._placement.check_rules_used(tree)
        make = functools.partial(outer.init, self._config, islands=self._islands)
        abstract = jax.eval_shape(make, tree)
        if shapes_only:
            return jax.tree.map(  # nothing allocated (distrain plan)
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract,
                self._shardings(abstract),
            )
        # One program builds the islands' copies where they live (no I copies on one device).
        return jax.jit(make, out_shardings=self._shardings(abstract))(tree)

    def _shardings(self, state: DiLoCoState) -> DiLoCoState:
        def rows(path: Any, x: Any) -> NamedSharding:
            return self.island_sharding(tuple(np.shape(x)), _layout.path_str(path))

        inner = jax.tree_util.tree_map_with_path(rows, state.inner)
        whole = self.state_shardings(state.replace(inner=None))
        return whole.replace(inner=inner)

    def _place(self, state: DiLoCoState) -> DiLoCoState:
        ours = set(self._devices)
        leaves = jax.tree.leaves(state)
        if all(isinstance(x, jax.Array) and x.sharding.device_set == ours for x in leaves):
            return state
        shardings = self._shardings(state)
        return jax.device_put(state, shardings)

    def global_view(self, state: DiLoCoState) -> Any:
        """The user's train state with the global parameters (the last synced model) and
        island 0's other fields: what evaluation, prediction and export use.

        Example:
          >>> eval_state = strategy.global_view(state)       # a dt.TrainState
          >>> strategy.run(eval_step, args=(eval_state, batch))
        """
        if not isinstance(state, DiLoCoState):
            raise TypeError(
                f"global_view takes the DiLoCoState of this strategy. Received: "
                f"{type(state).__name__}."
            )
        first = jax.tree.map(lambda x: x[0], state.inner)
        return outer.replace_params(first, state.params)

    # --------------------------------------------------------------------- run
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        *,
        donate_argnums: int | Sequence[int] = (),
    ) -> Any:
        """``Strategy.run``; a :class:`DiLoCoState` argument makes the call an inner step.

        ``fn`` receives the island's state in its place (the user's train state) and
        returns the new one (alone or first in a tuple); the strategy counts the step,
        runs the outer step after the H-th, and returns the new ``DiLoCoState`` in its
        place. Other results are per replica (islands in order) or mirrored.

        Raises:
          ValueError: more than one ``DiLoCoState`` argument; a state that differs
            across the replicas of an island.
          TypeError: ``fn`` returns no state of the structure it received.
        """
        context.require_cross_replica(self, "run")
        checked, kwargs, donate = _checks.check_run_arguments(fn, args, kwargs, donate_argnums)
        fn, call_args, kwargs = self._prepare_call(fn, checked, kwargs or {})
        out = self._compiler.run(fn, call_args, kwargs, donate)
        return jax.tree.map(
            lambda x: x.value if isinstance(x, PerGroup) else x,
            out,
            is_leaf=lambda x: isinstance(x, PerGroup),
        )

    def _prepare_call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
        """With a DiLoCoState argument: the inner step of ``fn`` (cached per ``fn``, so
        the compiler's per-function cache holds), the islands' states marked per island."""
        states = [x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_state) if _is_state(x)]
        if not states:
            return fn, args, kwargs
        if len(states) > 1:
            raise ValueError(
                f"strategy.run got {len(states)} DiLoCoState arguments; an inner step "
                "takes one (the islands' training state)."
            )
        step = self._steps.get(fn)
        if step is None:
            # The Trainer's fused steps already call the inner step once per batch.
            runs_inner = inspect.unwrap(fn, stop=lambda f: getattr(f, "_islands_of", None) is self)
            aware = getattr(runs_inner, "_islands_of", None) is self
            step = self._steps[fn] = _per_island_results(fn if aware else self._inner_step(fn))
        args, kwargs = jax.tree.map(
            lambda x: x.replace(inner=PerGroup(x.inner)) if _is_state(x) else x,
            (args, kwargs),
            is_leaf=_is_state,
        )
        return step, args, kwargs

    def training_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """The Trainer's step: the user's as an inner step, once per batch (one object
        per step, so the Trainer's compiled programs are reused)."""
        inner = self._train_steps.get(step)
        if inner is None:
            inner = self._train_steps[step] = self._inner_step(step)
        return inner

    def evaluation_state(self, state: Any) -> Any:
        """Evaluation and prediction see the global model (:meth:`global_view`)."""
        return self.global_view(state) if isinstance(state, DiLoCoState) else state

    def _inner_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as an inner step: the island's state in, the outer logic after (inside a
        replica, the island's state without its island axis)."""

        def step(*args: Any, **kwargs: Any) -> Any:
            (state,) = [
                x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_state) if _is_state(x)
            ]
            user_args, user_kwargs = jax.tree.map(
                lambda x: x.inner if _is_state(x) else x, (args, kwargs), is_leaf=_is_state
            )
            out = fn(*user_args, **user_kwargs)
            want = jax.tree.structure(state.inner)
            if jax.tree.structure(out) == want:  # type: ignore[operator]
                return self._after_step(state, out)
            if isinstance(out, tuple | list):
                for i, x in enumerate(out):
                    if jax.tree.structure(x) == want:  # type: ignore[operator]
                        new = self._after_step(state, x)
                        return type(out)([*out[:i], new, *out[i + 1 :]])
            raise TypeError(
                f"`{_checks.fn_name(fn)}` received a DiLoCoState's island state but returned no "
                "state of its structure (expected it alone or in a tuple, e.g. (state, loss)). "
                "An inner step returns the new state; to evaluate, pass "
                "strategy.global_view(state) instead of the DiLoCoState."
            )

        step.__name__ = step.__qualname__ = _checks.fn_name(fn)
        step.__wrapped__ = fn  # type: ignore[attr-defined]
        step._islands_of = self  # type: ignore[attr-defined]
        return step

    def _after_step(self, state: DiLoCoState, new_inner: Any) -> DiLoCoState:
        """Inside a replica: count the step, run the outer step it calls for."""
        alone = self._islands == 1
        if alone:  # nothing to exchange
            mean: Any = functools.partial(jax.tree.map, lambda x: x[0])
            gather: Any = None
        else:
            mean, gather = exchange(
                self._outer_sync, self.replicas_per_island, tuple(self.inner_axes)
            )
        stacked = state.replace(inner=jax.tree.map(lambda x: x[None], new_inner))
        stacked = outer.after_inner_step(self._config, stacked, gather=gather, mean=mean)
        return stacked.replace(inner=jax.tree.map(lambda x: x[0], stacked.inner))

    # ---------------------------------------------------------- cross-replica
    def _rows_per_replica(self, tree: Any) -> Any:
        """Island-varying arrays (one row per island) as per-replica values: each
        replica's component is its island's row."""
        k = self.replicas_per_island

        def one(x: Any) -> Any:
            if not self._is_island_array(x):
                return x
            rows = jnp.repeat(x, k, axis=0) if k > 1 else x
            return PerReplica(
                jax.device_put(rows, self._stacked), self.num_replicas_in_sync, stacked=True
            )

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, PerReplica))

    def _is_island_array(self, x: Any) -> bool:
        s = getattr(x, "sharding", None)
        return (
            isinstance(x, jax.Array)
            and isinstance(s, NamedSharding)
            and s.mesh == self._mesh
            and len(s.spec) > 0
            and s.spec[0] == ISLAND_AXIS
        )

    def reduce(self, op: Any, value: Any, axis: int | None = None) -> Any:
        """``Strategy.reduce`` over every replica of every island; an island-varying
        array (e.g. ``state.inner.params``) counts its island's row once per replica."""
        return super().reduce(op, self._rows_per_replica(value), axis)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """``Strategy.gather`` over every replica of every island, islands in order."""
        return super().gather(self._rows_per_replica(value), axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """One component per local replica, islands in order; an island-varying array
        gives each replica its island's row (without the island axis)."""
        return super().experimental_local_results(self._rows_per_replica(value))


def _per_island_results(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose returned DiLoCoStates mark their islands' states as one row per
    island (``PerGroup``) for the compiler."""

    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        return jax.tree.map(
            lambda x: x.replace(inner=PerGroup(x.inner)) if _is_state(x) else x,
            out,
            is_leaf=_is_state,
        )

    call.__name__ = call.__qualname__ = _checks.fn_name(fn)
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def _check_islands(islands: Any, devices: Sequence[jax.Device], per_replica: Any) -> None:
    if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1:
        raise ValueError(f"islands must be an int >= 1. Received: islands={islands!r}.")
    n = len(devices)
    if n % islands:
        raise ValueError(
            f"islands={islands} must divide the {n} devices (equal islands). Use one of "
            f"{[d for d in range(1, n + 1) if n % d == 0]}, or pass `devices`."
        )
    if isinstance(per_replica, Mapping) and ISLAND_AXIS in per_replica:
        raise ValueError(
            f"devices_per_replica names the axis {ISLAND_AXIS!r}, which is the islands' "
            f"own. Received: {dict(per_replica)!r}. Rename that inner axis."
        )
    k = (
        math.prod(per_replica.values())
        if isinstance(per_replica, Mapping)
        else per_replica
        if isinstance(per_replica, int) and not isinstance(per_replica, bool)
        else None
    )
    if k and (n // islands) % k:
        raise ValueError(
            f"Each island has {n // islands} devices, which devices_per_replica={per_replica!r} "
            f"({k} devices per replica) must divide. Use fewer islands or smaller replicas."
        )
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    size = n // islands
    for i in range(islands):
        procs = {d.process_index for d in devices[i * size : (i + 1) * size]}
        whole = (
            all(per_process[p] <= size for p in procs)
            and sum(per_process[p] for p in procs) == size
        )
        if len(procs) > 1 and not whole:
            raise ValueError(
                f"Island {i} would cut a process in pieces (devices per process: "
                f"{sorted(per_process.values())}, {size} devices per island): an island is "
                "whole processes or part of one. Use a number of islands that divides the "
                "processes, or a multiple of it."
            )
