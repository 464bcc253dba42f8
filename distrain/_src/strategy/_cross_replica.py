"""Cross-replica kernels: reducing, gathering and splitting distributed values.

``Strategy.reduce`` / ``gather`` / ``experimental_local_results`` (``base.py``) walk
the user's pytree; the compiled kernels here work on one leaf. A per-replica leaf is
viewed as ``[num_replicas, *component_shape]``: stacked results of ``run`` already have
that shape, split batches are reshaped to it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from distrain._src.context import ReduceOp
from distrain._src.data.options import ValueContext
from distrain._src.strategy import _checks
from distrain._src.values import PerReplica

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy
    from distrain._src.strategy.replica_layout import ReplicaLayout


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def reduce_tree(strategy: Strategy, op: ReduceOp, value: Any, axis: int | None) -> Any:
    """``Strategy.reduce`` of every leaf of ``value`` (see its docstring)."""
    n = strategy.num_replicas_in_sync
    replicated = strategy.replica_layout.replicated

    def one(x: Any) -> Any:
        if isinstance(x, PerReplica):
            _checks.check_per_replica(strategy, x, jax.tree.leaves(x.value))
            return jax.tree.map(
                lambda a: reducer(
                    op, component_axis(axis, a, x.stacked, "reduce"), x.stacked, n, replicated
                )(a),
                x.value,
            )
        if strategy.replica_layout.is_mirrored(x):
            a = component_axis(axis, x, False, "reduce")
            return mirrored_reducer(op, a, n, x.sharding)(x)
        if op is ReduceOp.SUM and n > 1:
            raise ValueError(
                f"Only results of `strategy.run` can be reduced with SUM over {n} "
                f"replicas. Received a value of type {type(x).__name__}: neither a "
                "dt.PerReplica nor an array this strategy placed on its replicas (it "
                f"would count one value {n} times). Pass what `strategy.run` returned, or "
                "use MEAN."
            )
        a = component_axis(axis, x, False, "reduce")
        x = jnp.asarray(x)
        return x if a is None else jnp.mean(x, a) if op is ReduceOp.MEAN else jnp.sum(x, a)

    return jax.tree.map(one, value, is_leaf=_is_per_replica)


def gather_tree(strategy: Strategy, value: Any, axis: int) -> Any:
    """``Strategy.gather`` of every leaf of ``value`` (see its docstring)."""
    n = strategy.num_replicas_in_sync
    replicated = strategy.replica_layout.replicated

    def one(x: Any) -> Any:
        if isinstance(x, PerReplica):
            _checks.check_per_replica(strategy, x, jax.tree.leaves(x.value))
            return jax.tree.map(
                lambda a: gatherer(
                    component_axis(axis, a, x.stacked, "gather", scalar_ok=True),
                    x.stacked,
                    n,
                    replicated,
                )(a),
                x.value,
            )
        x = jnp.asarray(x)
        a = component_axis(axis, x, False, "gather")
        return jnp.concatenate([x] * n, a)

    return jax.tree.map(one, value, is_leaf=_is_per_replica)


def local_components(
    local: Sequence[tuple[int, tuple[jax.Device, ...]]], value: Any
) -> tuple[Any, ...]:
    """``value`` with each per-replica leaf replaced by each local replica's component."""

    def component(x: Any, devices: tuple[jax.Device, ...]) -> Any:
        if not isinstance(x, PerReplica):
            return x
        return jax.tree.map(lambda a: component_on(a, devices, x.stacked), x.value)

    return tuple(
        jax.tree.map(functools.partial(component, devices=d), value, is_leaf=_is_per_replica)
        for _, d in local
    )


def stacked_values(layout: ReplicaLayout, n: int, value_fn: Callable[[Any], Any]) -> Any:
    """A stacked ``PerReplica`` of ``value_fn(ctx)`` for each local replica
    (``Strategy.experimental_distribute_values_from_function``)."""
    local = layout.local_replicas()
    per_group = n // math.prod(layout.mesh.shape[a] for a in layout.group_axes)
    values = [value_fn(ValueContext(i, n, i // per_group)) for i, _ in local]
    per_value = _checks.check_replica_values([i for i, _ in local], values)
    leaves0, treedef = jax.tree.flatten(values[0])
    out = []
    for j, leaf in enumerate(leaves0):
        shards = [
            jax.device_put(np.asarray(per_value[r][j])[None], d)
            for r, (_, devices) in enumerate(local)
            for d in devices
        ]
        shape = (n, *np.shape(leaf))
        out.append(jax.make_array_from_single_device_arrays(shape, layout.stacked, shards))
    stacked = jax.tree.unflatten(treedef, out)
    return jax.tree.map(lambda x: PerReplica(x, n, stacked=True), stacked)


def component_on(x: jax.Array, devices: tuple[jax.Device, ...], stacked: bool) -> jax.Array:
    """One replica's component of a per-replica leaf, from the shards on its devices.

    A stacked row is whole on each of the replica's devices; a split batch's rows may be
    spread over them (each shard's index says which rows it holds).
    """
    shards = [s for s in x.addressable_shards if s.device in devices]
    if stacked:
        return shards[0].data[0]
    by_row = {(s.index[0].start or 0) if s.index else 0: s.data for s in shards}
    parts = [by_row[r] for r in sorted(by_row)]
    if len(parts) == 1:
        return parts[0]
    return jnp.concatenate(jax.device_put(parts, devices[0]))  # on the replica's first device


def _grouped(x: jax.Array, stacked: bool, n: int) -> jax.Array:
    """Views a per-replica leaf as ``[n, *component_shape]``."""
    return x if stacked else x.reshape(n, x.shape[0] // n, *x.shape[1:])


def component_axis(
    axis: Any,
    x: Any,
    stacked: bool,
    method: str,
    *,
    scalar_ok: bool = False,
) -> int | None:
    """``axis`` normalised to a component's dimensions, or a clear error.

    A component of a stacked per-replica leaf has one dimension less than the leaf; a
    split leaf's components (and a mirrored array) have the leaf's rank. Scalar components
    are gathered one row each (``scalar_ok``), as TensorFlow does.
    """
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(
            f"`strategy.{method}(..., axis=...)` takes an int or None. Received: "
            f"axis={axis!r} of type {type(axis).__name__}."
        )
    ndim = np.ndim(x) - (1 if stacked else 0)
    if ndim == 0 and scalar_ok:
        return 0
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"`strategy.{method}(..., axis={axis})` is out of range for per-replica values of "
            f"rank {ndim} (valid: {-ndim}..{ndim - 1})"
            + ("; scalar values have no axis to reduce: pass axis=None." if ndim == 0 else ".")
        )
    return int(axis) % ndim


@functools.cache
def reducer(op: ReduceOp, axis: int | None, stacked: bool, n: int, out: NamedSharding):
    def f(x: jax.Array) -> jax.Array:
        g = _grouped(x, stacked, n)
        axes = (0,) if axis is None else (0, axis + 1)
        return jnp.mean(g, axes) if op is ReduceOp.MEAN else jnp.sum(g, axes)

    return jax.jit(f, out_shardings=out)


@functools.cache
def mirrored_reducer(op: ReduceOp, axis: int | None, n: int, out: jax.sharding.Sharding):
    """Reduces an array every replica holds a copy of: SUM counts it ``n`` times."""

    def f(x: jax.Array) -> jax.Array:
        if axis is not None:
            x = jnp.mean(x, axis) if op is ReduceOp.MEAN else jnp.sum(x, axis)
        return x if op is ReduceOp.MEAN else x * jnp.asarray(n, x.dtype)

    return jax.jit(f, out_shardings=out)


@functools.cache
def gatherer(axis: int, stacked: bool, n: int, out: NamedSharding):
    def f(x: jax.Array) -> jax.Array:
        g = _grouped(x, stacked, n)
        if g.ndim == 1:  # scalar components: one row each
            return g
        a = axis
        g = jnp.moveaxis(g, 0, a)
        return g.reshape(*g.shape[:a], g.shape[a] * g.shape[a + 1], *g.shape[a + 2 :])

    return jax.jit(f, out_shardings=out)
