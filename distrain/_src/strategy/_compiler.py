"""Compiles per-replica functions once and dispatches them on ``jax.jit``'s fast path.

Who owns what:

* ``Strategy`` (``base.py``) says *where* things live (its mesh, where state lives, how
  batches are split) and hands ``run`` to a :class:`ReplicaCompiler` it owns;
* :class:`ReplicaCompiler` (this module) turns ``fn`` into one ``jax.jit`` program per
  argument *structure*, runs it, and bounds the calls in flight;
* ``_global_program.py`` builds that program: one replica's trace, ``shard_map`` over
  the replica (and group) axes, the results placed;
* ``_replication.py`` decides which outputs are identical on every replica;
* ``_cross_replica.py`` reduces and gathers the results.

Steady state, ``run`` costs one C++ flatten of ``(args, kwargs)``, one dict lookup, a
type check of the leaves and the ``jax.jit`` call. ``dt.PerReplica`` is a pytree node
whose replica count and kind (split batch / stacked result) live in its treedef, so the
flatten's treedef alone tells which program applies; in-specs are derived from it at
trace time. Non-array leaves (Python numbers, strings, ...) are compile-time constants,
as values captured by ``tf.function`` are: they key the cache by value.

``shard_map(..., check_vma=False)`` keeps gradients per replica, as in
``tf.distribute`` (with the default ``True``, ``jax.grad`` w.r.t. a broadcast input
already sums over replicas, and an explicit all-reduce would count gradients N times).

A replica that spans several devices (``devices_per_replica``, ``layout.py``): the
``shard_map`` is manual over the replica axis only, and XLA partitions each replica's
program over the inner axis from the inputs' shardings; results identical on every
replica are constrained to the state's layout. A single replica over every device is
the whole program: the replica context elides its collectives over one replica in the
trace that runs (XLA rejects an all-reduce over a manual axis of size 1), so the step
compiles as a hand-written ``jax.jit`` FSDP program, while the replica analysis reads
the program as written. A program that still names the replica axis (a user's own
``lax.psum``) runs under ``jax.vmap`` over a replica axis of size 1 instead.

Replica groups (DiLoCo's islands, the layout's ``group_axes``): the program is manual
over the group axis too. Leaves inside a ``PerGroup`` argument have a row per group
(the replicas of group ``g`` see row ``g``); results a replica function returns inside
a ``PerGroup`` come back with a row per group, and must be identical on a group's
replicas (checked by the replica analysis); other results that differ across groups
come back per replica. The replica context's collectives, replica id and count are
the group's.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from distrain._src import context
from distrain._src.context import ReplicaContext
from distrain._src.strategy import _checks
from distrain._src.strategy._global_program import global_program, is_distributed, leaf_kinds
from distrain._src.values import PerGroup, PerReplica

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy

# The concrete classes of the jax.Arrays seen so far (ArrayImpl): a set of exact types
# is the cheapest check on the hot path. Filled by the slow path, never at import (an
# array made at import would start JAX's backends before jax.distributed can).
_ARRAY_TYPES: set[type] = set()


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


class _Program:
    """One compiled replica function for one argument structure.

    Attributes:
      jitted: ``jax.jit`` of the global program; takes the array leaves in flatten order.
      static_idx: flatten positions of compile-time constants (usually none).
      static: their values, compared on every call.
      n_leaves: the flatten's length.
    """

    __slots__ = ("jitted", "static_idx", "static", "n_leaves")

    def __init__(self, jitted: Callable[..., Any], flat: list[Any], static_idx: tuple[int, ...]):
        self.jitted = jitted
        self.static_idx = static_idx
        self.static = tuple(flat[i] for i in static_idx)
        self.n_leaves = len(flat)

    def arrays(self, flat: list[Any]) -> list[Any] | None:
        """The program's inputs, or None when these leaves need another program."""
        if not self.static_idx:
            return flat if set(map(type, flat)) <= _ARRAY_TYPES else None
        for i, s in zip(self.static_idx, self.static, strict=True):
            x = flat[i]
            if type(x) is not type(s) or not (x is s or x == s):
                return None
        static = set(self.static_idx)
        arrays = [x for i, x in enumerate(flat) if i not in static]
        return arrays if set(map(type, arrays)) <= _ARRAY_TYPES else None


class ReplicaCompiler:
    """``strategy.run``'s engine for one strategy.

    Args:
      strategy: the strategy whose mesh, axis name and cross-device ops programs use.
      max_in_flight: ``run`` calls that may be queued before the host waits for the
        oldest (bounded: an unbounded queue of collectives deadlocks on CPU).
    """

    def __init__(self, strategy: Strategy, max_in_flight: int = 2) -> None:
        self._strategy = strategy
        self._programs: dict[Hashable, _Program] = {}  # the fast path: by structure
        self._compiled: dict[Hashable, _Program] = {}  # by structure, types and constants
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._max_in_flight = max_in_flight
        self._moves: bool | None = None  # state off the compute mesh: decided on first run

    @property
    def num_programs(self) -> int:
        """How many programs were compiled (one per function, structure and constants)."""
        return len(self._compiled)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, donate: tuple) -> Any:
        flat, treedef = jax.tree.flatten((args, kwargs))
        key = (fn, treedef, donate)
        program = self._programs.get(key)
        arrays = program.arrays(flat) if program is not None else None
        if program is None or arrays is None:
            program, arrays = self._lookup(key, fn, args, kwargs, flat, treedef)
        if self._moves is None:
            self._moves = self._state_off_mesh()
        if self._moves:
            arrays = self._to_compute(arrays, treedef, program)
        while len(self._in_flight) >= self._max_in_flight:
            self._in_flight.popleft().block_until_ready()
        try:
            out, done = program.jitted(*arrays)
        except (ValueError, TypeError):
            _checks.diagnose_per_replica(self._strategy, args, kwargs)  # the clearer error
            raise
        self._in_flight.append(done)
        return self._home(out) if self._moves else out

    def compile(self, fn: Callable[..., Any], args: tuple, kwargs: dict, donate: tuple = ()) -> Any:
        """The compiled program ``run(fn, args, kwargs, donate)`` would execute, not run."""
        flat, treedef = jax.tree.flatten((args, kwargs))
        program, arrays = self._lookup((fn, treedef, donate), fn, args, kwargs, flat, treedef)
        if self._state_off_mesh():
            arrays = self._to_compute(arrays, treedef, program)
        jitted: Any = program.jitted  # a jax.jit-wrapped function
        return jitted.lower(*arrays).compile()

    def output_shapes(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One replica's result shapes of ``fn``, traced as ``run`` traces it (the replica
        context, its axes and the context mesh bound), nothing compiled."""
        strategy = self._strategy
        n, axis, mesh = strategy.num_replicas_in_sync, strategy.axis_name, strategy.mesh
        groups = strategy.replica_layout.group_axes
        per_group = n // int(np.prod([mesh.shape[a] for a in groups], dtype=int))
        flat, treedef = jax.tree.flatten((args, kwargs))
        kinds = leaf_kinds(jax.tree.unflatten(treedef, range(len(flat))))

        def local(i: int, x: Any) -> Any:
            if not isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
                return x  # a compile-time constant, as in run
            shape, kind = tuple(np.shape(x)), kinds.get(i)
            if kind in ("stacked", "group"):
                shape = shape[1:]
            elif kind == "split":
                shape = (shape[0] // n, *shape[1:])
            return jax.ShapeDtypeStruct(shape, jnp.result_type(x))

        avals = [local(i, x) for i, x in enumerate(flat)]
        local_args, local_kwargs = jax.tree.map(
            lambda x: x.value if is_distributed(x) else x,
            jax.tree.unflatten(treedef, avals),
            is_leaf=is_distributed,
        )
        ctx = ReplicaContext(
            strategy, axis, strategy.cross_device_ops, num_replicas=per_group if groups else None
        )
        axis_env = [*((a, mesh.shape[a]) for a in groups), (axis, per_group)]
        with (
            context._enter_scope(strategy),
            context._enter_replica(ctx),
            strategy.replica_layout.mesh_context(),
        ):
            _, shapes = jax.make_jaxpr(
                lambda a, k: fn(*a, **k), axis_env=axis_env, return_shape=True
            )(local_args, local_kwargs)
        return jax.tree.map(
            lambda x: x.value if isinstance(x, PerGroup) else x,
            shapes,
            is_leaf=lambda x: isinstance(x, PerGroup),
        )

    def _state_off_mesh(self) -> bool:
        """Central storage keeps state off the compute mesh: broadcast inputs move to the
        mesh and replicated results back; the others place nothing per call."""
        strategy = self._strategy
        return not strategy.state_sharding(()).is_equivalent_to(strategy._replicated, 0)

    # ----------------------------------------------------------------- compile
    def _lookup(self, key, fn, args, kwargs, flat, treedef) -> tuple[_Program, list[Any]]:
        """The program for these leaves' types and constants (compiled on first use).

        NumPy leaves become device arrays (broadcast inputs); the latest program of a
        structure stays the fast path's.
        """
        for leaf in jax.tree.leaves((args, kwargs), is_leaf=_is_per_replica):
            if isinstance(leaf, PerReplica):
                _checks.check_per_replica(self._strategy, leaf, jax.tree.leaves(leaf.value))
        _checks.check_run_dtypes(fn, args, kwargs)
        flat = [jnp.asarray(x) if isinstance(x, np.ndarray | np.generic) else x for x in flat]
        # Abstract leaves (memory_analysis of a state that was never allocated) are
        # program inputs too.
        static_idx = tuple(
            i for i, x in enumerate(flat) if not isinstance(x, jax.Array | jax.ShapeDtypeStruct)
        )
        _ARRAY_TYPES.update(type(x) for x in flat if isinstance(x, jax.Array))
        static = [flat[i] for i in static_idx]
        full_key = (key, static_idx, _checks.hashable_constants(static, fn))
        program = self._compiled.get(full_key)
        if program is None:
            donated = _donated_positions(args, key[2], treedef, static_idx)
            global_fn = global_program(self._strategy, fn, treedef, flat, static_idx)
            program = _Program(jax.jit(global_fn, donate_argnums=donated), flat, static_idx)
            self._compiled[full_key] = program
        self._programs[key] = program
        skip = set(static_idx)
        return program, [x for i, x in enumerate(flat) if i not in skip]

    def _home(self, tree: Any) -> Any:
        """Replicated results moved to where state lives (central storage)."""
        layout = self._strategy.replica_layout

        def home(x: Any) -> Any:
            if isinstance(x, PerReplica):
                return x
            return jax.device_put(x, layout.state_sharding(np.shape(x)))

        return jax.tree.map(home, tree, is_leaf=_is_per_replica)

    def _to_compute(self, arrays: list[Any], treedef: Any, program: _Program) -> list[Any]:
        """Broadcast inputs to the compute devices (central storage)."""
        marked = treedef.unflatten(range(program.n_leaves))
        split = {
            i
            for leaf in jax.tree.leaves(marked, is_leaf=_is_per_replica)
            if isinstance(leaf, PerReplica)
            for i in jax.tree.leaves(leaf.value)
        }
        static = set(program.static_idx)
        positions = [i for i in range(program.n_leaves) if i not in static]
        return [
            x if i in split else jax.device_put(x, self._strategy.replica_layout.replicated)
            for i, x in zip(positions, arrays, strict=True)
        ]


def _donated_positions(
    args: tuple, donate: tuple[int, ...], treedef: Any, static_idx: tuple[int, ...]
) -> tuple[int, ...]:
    """Indices (among the program's array inputs) of the donated arguments' leaves.

    Per-replica leaves are never donated: jax 0.11.2 crashed (SIGSEGV, 8 CPU devices)
    when a stacked per-replica state was donated back into the next step.
    """
    if not donate:
        return ()
    bad = [a for a in donate if isinstance(a, bool) or not isinstance(a, int)]
    if bad or not all(0 <= a < len(args) for a in donate):
        raise ValueError(
            f"`donate_argnums` must be indices of the {len(args)} positional args. "
            f"Received: {donate!r}."
        )
    n_leaves = treedef.num_leaves
    marked_args, _ = treedef.unflatten(range(n_leaves))
    per_replica = {
        i
        for leaf in jax.tree.leaves(marked_args, is_leaf=_is_per_replica)
        if isinstance(leaf, PerReplica)
        for i in jax.tree.leaves(leaf.value)
    }
    static = set(static_idx)
    position: dict[int, int] = {}
    for i in range(n_leaves):
        if i not in static:
            position[i] = len(position)
    chosen = {
        i
        for a in donate
        for i in jax.tree.leaves(marked_args[a])
        if i not in per_replica and i not in static
    }
    return tuple(sorted(position[i] for i in chosen))
