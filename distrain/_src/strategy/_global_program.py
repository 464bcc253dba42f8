"""One replica function as one global program: ``shard_map`` over the replica axis.

:func:`global_program` turns a replica function and an argument structure into the
function ``ReplicaCompiler`` hands to ``jax.jit``: it traces one replica's program (the
replica context, its axes and the context mesh bound), reads from the program as written
which results differ across replicas (``_replication.py``), and runs it manual over the
replica axis (and the group axis) only. Split inputs, stacked results and ``PerGroup``
rows get their in- and out-specs from the structure alone; results identical on every
replica are laid out as the strategy keeps state, per-group results over the groups.

A single replica over every device is the whole program (plain GSPMD), or ``vmap`` over
a replica axis of size 1 when the program names the replica axis itself (a user's own
``lax.psum``); ``_compiler.py``'s docstring says why.

Example:
  >>> fn = global_program(strategy, step, treedef, flat, static_idx=())
  >>> outputs, done = jax.jit(fn)(*arrays)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from distrain._src import context
from distrain._src.context import ReplicaContext
from distrain._src.strategy import _checks, layout
from distrain._src.strategy._replication import collectives_over, varying_outputs
from distrain._src.values import PerGroup, PerReplica

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy

__all__ = ["global_program", "is_distributed", "leaf_kinds"]


def is_distributed(x: Any) -> bool:
    """Whether ``x`` is a ``PerReplica`` or ``PerGroup`` node."""
    return isinstance(x, PerReplica | PerGroup)


def leaf_kinds(tree: Any) -> dict[int, str]:
    """``{leaf index: kind}`` of a pytree whose leaves are their flatten indices: the
    leaves of ``PerReplica`` nodes are ``"split"`` or ``"stacked"``, of ``PerGroup``
    nodes ``"group"``."""
    kinds: dict[int, str] = {}
    for node in jax.tree.leaves(tree, is_leaf=is_distributed):
        if isinstance(node, PerGroup):
            kinds.update(dict.fromkeys(jax.tree.leaves(node.value), "group"))
        elif isinstance(node, PerReplica):
            kind = "stacked" if node.stacked else "split"
            kinds.update(dict.fromkeys(jax.tree.leaves(node.value), kind))
    return kinds


class _Structure:
    """What the argument structure says of a program: its axes, which inputs are split,
    stacked or per group, their in-specs, and the compile-time constants."""

    def __init__(self, strategy: Strategy, treedef: Any, flat: list[Any], static_idx: tuple):
        self.n, self.axis, mesh = strategy.num_replicas_in_sync, strategy.axis_name, strategy.mesh
        self.spans = bool(strategy.inner_axes)
        # Replica groups (DiLoCo's islands): an outer manual axis; the replica context,
        # its collectives and its replica count stay inside the group.
        self.groups = groups = strategy.replica_layout.group_axes
        self.g = int(np.prod([mesh.shape[a] for a in groups], dtype=int))
        self.per_group = self.n // self.g
        self.rep = (*groups, self.axis) if groups else self.axis
        self.axis_env = [*((a, mesh.shape[a]) for a in groups), (self.axis, self.per_group)]
        self.static = {i: flat[i] for i in static_idx}
        self.n_leaves = len(flat)
        self.treedef = treedef
        # Which leaves are split over the replicas, which are stacked results (one row
        # per replica) and which have a row per group, from the structure alone:
        # PerReplica and PerGroup nodes in the treedef.
        kinds = leaf_kinds(treedef.unflatten(range(self.n_leaves)))
        self.array_kinds = [kinds.get(i) for i in range(self.n_leaves) if i not in self.static]
        # Replicas that span devices get their replica id as a first, split input:
        # axis_index does not lower in a partly manual program without a context mesh.
        self.in_kinds: list[str | None] = [*(["split"] * self.spans), *self.array_kinds]
        self.in_varying = [k in ("split", "stacked") for k in self.in_kinds]  # over the axis
        self.in_specs = tuple(
            P(*groups) if k == "group" else P(self.rep) if k is not None else P()
            for k in self.in_kinds
        )

    def with_constants(self, arrays: Sequence[Any]) -> list[Any]:
        it = iter(arrays)
        return [self.static[i] if i in self.static else next(it) for i in range(self.n_leaves)]


def _replica_fn(strategy: Strategy, fn: Callable[..., Any], s: _Structure) -> Callable[..., Any]:
    """One replica's program: ``fn`` on its part of the arguments, in its context."""

    def per_replica(*arrays: Any, elide: bool = False) -> Any:
        replica_id = arrays[0][0] % s.per_group if s.spans else None
        pairs = zip(arrays[s.spans :], s.array_kinds, strict=True)
        local = [x[0] if k in ("stacked", "group") else x for x, k in pairs]
        # Each replica sees the value of its part, not the PerReplica wrapper.
        args, kwargs = jax.tree.map(
            lambda x: x.value if is_distributed(x) else x,
            s.treedef.unflatten(s.with_constants(local)),
            is_leaf=is_distributed,
        )
        inputs = jax.tree.leaves((args, kwargs))
        ctx = ReplicaContext(
            strategy,
            s.axis,
            strategy.cross_device_ops,
            replica_id,
            elide,
            num_replicas=s.per_group if s.groups else None,
        )
        with context._enter_scope(strategy), context._enter_replica(ctx):
            out = fn(*args, **kwargs)
        _checks.check_traced_step(fn, args, kwargs, inputs, out)
        return out

    return per_replica


def _varying(
    fn: Callable[..., Any], s: _Structure, closed: Any, out_shape: Any
) -> tuple[list[bool], list[Any], Any, dict[int, str]]:
    """``(varying, paths, out_tree, out_groups)``: which results differ across replicas
    (read from the program as written), their paths and tree, the per-group results."""
    varying = varying_outputs(closed, s.in_varying, s.axis)
    if s.groups:  # a result that differs across groups is per replica too
        across = varying_outputs(closed, [k is not None for k in s.in_kinds], s.groups[0])
    paths, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    out_groups = _group_paths(out_tree)
    for i in out_groups:
        if varying[i]:
            raise _group_varies(fn, paths[i][0])
    if s.groups:
        varying = [
            v or (a and i not in out_groups)
            for i, (v, a) in enumerate(zip(varying, across, strict=True))
        ]
    return varying, paths, out_tree, out_groups


def global_program(
    strategy: Strategy,
    fn: Callable[..., Any],
    treedef: Any,
    flat: list[Any],
    static_idx: tuple[int, ...],
) -> Callable[..., Any]:
    """The global program of ``fn`` for the arguments ``treedef`` and ``flat`` describe
    (``static_idx``: the positions of compile-time constants); it takes the array leaves
    and returns ``(outputs, done)``, ``done`` a scalar ready when the program is."""
    s = _Structure(strategy, treedef, flat, static_idx)
    n, axis, groups, spans = s.n, s.axis, s.groups, s.spans
    in_mesh = strategy.replica_layout.mesh_context
    per_replica = _replica_fn(strategy, fn, s)

    def global_fn(*arrays: Any) -> Any:
        if spans:
            arrays = (jnp.arange(n, dtype=jnp.int32), *arrays)
        local = [
            _local_aval(x, {"split": n, "stacked": n, "group": s.g}.get(k or "", 1))
            for x, k in zip(arrays, s.in_kinds, strict=True)
        ]
        with in_mesh():
            closed, out_shape = jax.make_jaxpr(per_replica, axis_env=s.axis_env, return_shape=True)(
                *local
            )
        _checks.check_captured_consts(fn, closed.consts)
        varying, paths, out_tree, out_groups = _varying(fn, s, closed, out_shape)
        one = spans and n == 1
        # What runs: the replica context's collectives over one replica elided
        # (XLA rejects an all-reduce over a manual axis of size 1 beside auto axes).
        if spans and s.per_group == 1:
            with in_mesh():
                closed = jax.make_jaxpr(
                    functools.partial(per_replica, elide=True), axis_env=s.axis_env
                )(*local)

        def body(*xs: Any) -> list[Any]:
            outs = jaxpr_as_fun(closed)(*xs)
            # A replicated scalar that is ready when the program is: the host waits
            # on it to bound the calls in flight (results may be donated later).
            done = jnp.zeros((), jnp.int8)
            rows = [
                o[None] if v or i in out_groups else o
                for i, (o, v) in enumerate(zip(outs, varying, strict=True))
            ]
            return [*rows, done]

        out_specs = [
            P(*groups) if i in out_groups else P(s.rep) if v else P() for i, v in enumerate(varying)
        ]
        if one and collectives_over(closed, axis):  # a user's own collective
            *outs, done = _one_replica(body, arrays, s.in_varying, axis)
        elif one:  # the replica is the whole program: plain GSPMD
            *outs, done = body(*arrays)
        else:
            *outs, done = jax.shard_map(
                body,
                mesh=strategy.mesh,
                in_specs=s.in_specs,
                out_specs=[*out_specs, P()],
                axis_names={*groups, axis},
                check_vma=False,
            )(*arrays)
        outs = [
            _place_group(strategy, o, out_groups[i])
            if i in out_groups
            else PerReplica(_stacked(strategy, o) if spans else o, n, stacked=True)
            if v
            else _place_state(strategy, o, layout.path_str(p))
            for i, (o, v, (p, _)) in enumerate(zip(outs, varying, paths, strict=True))
        ]
        return jax.tree.unflatten(out_tree, outs), done

    global_fn.__name__ = f"replica_{_checks.fn_name(fn)}"
    return global_fn


def _one_replica(
    body: Callable[..., list[Any]], arrays: Sequence[Any], in_varying: list[bool], axis: str
) -> list[Any]:
    """``body`` for a single replica spanning every device whose program all-reduces over
    the replica axis (a user's ``lax.psum``): ``vmap`` over a replica axis of size 1, so
    ``body`` sees its inputs and returns its results exactly as under ``shard_map``.
    Slower than the plain program (batched matmuls of size 1 cost layout transposes)."""
    xs = [x[None] if v else x for x, v in zip(arrays, in_varying, strict=True)]
    in_axes = [0 if v else None for v in in_varying]
    outs = jax.vmap(body, in_axes=in_axes, out_axes=0, axis_name=axis, axis_size=1)(*xs)
    return [o[0] for o in outs]


def _stacked(strategy: Strategy, x: jax.Array) -> jax.Array:
    """A per-replica result whole on each device of its replica (one row per replica)."""
    return jax.lax.with_sharding_constraint(x, strategy._stacked)


def _place_state(strategy: Strategy, x: jax.Array, path: str = "") -> jax.Array:
    """A replicated result laid out as the strategy keeps state of its shape and path.

    A sharded layout on the mesh (one slice per replica, or split over a replica's
    devices) costs no communication: every replica holds the whole value and keeps its
    slice. Layouts off the mesh (central storage) are applied after the call.
    """
    target = strategy.state_sharding(x.shape, path)
    if target is strategy._replicated or not isinstance(target, jax.sharding.NamedSharding):
        return x
    if target.is_fully_replicated or target.device_set != strategy._replicated.device_set:
        return x  # off the compute devices (central storage): placed after the call
    return jax.lax.with_sharding_constraint(x, target)


def _local_aval(x: Any, parts: int) -> jax.ShapeDtypeStruct:
    """What one replica sees of ``x``, split in ``parts`` along its first axis (1: whole)."""
    shape = tuple(x.shape)
    if parts > 1:
        shape = (shape[0] // parts, *shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype, weak_type=getattr(x, "weak_type", False))


def _group_paths(out_tree: Any) -> dict[int, str]:
    """``{output index: its path inside its PerGroup node}`` for the results a replica
    function returns per group (the path is what layout rules match)."""
    marked = out_tree.unflatten(range(out_tree.num_leaves))
    out: dict[int, str] = {}
    for node in jax.tree.leaves(marked, is_leaf=is_distributed):
        if isinstance(node, PerGroup):
            for path, i in jax.tree_util.tree_flatten_with_path(node.value)[0]:
                out[i] = layout.path_str(path)
    return out


def _group_varies(fn: Any, path: Any) -> ValueError:
    return ValueError(
        f"`{_checks.fn_name(fn)}` returned a state leaf ({layout.path_str(path)!r}) that "
        "differs across the replicas of one island: inside an island the replicas must "
        "keep one state. All-reduce the gradients before applying them (TrainState."
        "apply_gradients does) or average the values with the replica context's "
        "all_reduce."
    )


def _place_group(strategy: Strategy, x: jax.Array, path: str) -> jax.Array:
    """A per-group result (leading group axis) laid out over the groups, and inside each
    group as the strategy keeps state of its shape and path."""
    target = strategy.replica_layout.group_sharding(tuple(x.shape), path)
    return jax.lax.with_sharding_constraint(x, target)
