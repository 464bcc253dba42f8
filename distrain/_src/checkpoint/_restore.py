"""Reading a state back: abstract targets, placement, key re-wrapping, verification.

``restore_state`` builds the abstract tree orbax restores into (one
``ShapeDtypeStruct`` with a sharding per jax leaf, an empty NumPy array per host
leaf), reads the ``state`` item, checks every leaf against the fingerprint taken
at save time, then turns the stored form back into the caller's: PRNG key data
into typed keys, the saved dtype into the target's dtype, 0-d NumPy arrays into
Python numbers where the target had numbers.

Leaves are read in the dtype they were saved in and cast afterwards, so even a
dtype-changing restore is verified; only dtypes JAX cannot hold in its current
configuration (64-bit without ``jax_enable_x64``) are read in the target dtype
directly, unverified.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from distrain._src.checkpoint import _fingerprint, _layout, _quiet
from distrain._src.checkpoint._layout import CheckpointCorruptionError, LeafInfo
from distrain._src.pytree import PyTree


def _representable(dtype: np.dtype) -> bool:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype)) == np.dtype(dtype)


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def stored_sharding(x: Any) -> jax.sharding.Sharding | None:
    """Where the stored form of target leaf ``x`` goes (None: a host value).

    A typed key's stored form is its key data: the key's shape plus trailing key dims,
    which the key's sharding places too (its spec names the key's own dims; the trailing
    ones stay whole)."""
    if not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return None
    if isinstance(x, jax.Array) and _layout.is_prng_key(x):
        return jax.random.key_data(x).sharding
    return getattr(x, "sharding", None) or _default_sharding()


def _abstract_leaf(x: Any, info: LeafInfo) -> tuple[Any, bool]:
    """What orbax restores this leaf into, and whether it is read in the saved dtype."""
    saved = np.dtype(info.dtype)
    sharding = stored_sharding(x)
    if sharding is not None:
        if _layout.is_prng_key(x):
            return jax.ShapeDtypeStruct(info.shape, saved, sharding=sharding), True
        if _representable(saved):
            return jax.ShapeDtypeStruct(info.shape, saved, sharding=sharding), True
        return jax.ShapeDtypeStruct(info.shape, x.dtype, sharding=sharding), False
    return np.empty(info.shape, saved), True


def _finish_leaf(value: Any, x: Any, info: LeafInfo) -> Any:
    """Turns a restored leaf into the form of the target leaf ``x``."""
    if _layout.is_prng_key(x):
        return jax.random.wrap_key_data(value, impl=info.key_impl or str(jax.random.key_impl(x)))
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return value if value.dtype == x.dtype else value.astype(x.dtype)
    if isinstance(x, np.ndarray):
        return value if value.dtype == x.dtype else value.astype(x.dtype)
    if isinstance(x, np.generic):
        return np.asarray(value).astype(x.dtype)[()]
    if isinstance(x, bool | int | float | complex):
        return type(x)(np.asarray(value).item())
    return value


def _verify(restored: list[tuple[str, Any]], by_path: dict[str, LeafInfo], checked: list[bool]):
    todo = [(p, v) for (p, v), c in zip(restored, checked, strict=True) if c]
    fps = _fingerprint.fingerprint_any([v for _, v in todo])
    for (path, _), fp in zip(todo, fps, strict=True):
        expected = by_path[path].fingerprint
        if expected is not None and fp is not None and fp != expected:
            raise CheckpointCorruptionError(
                f"the data read back for leaf {path!r} does not match the fingerprint taken "
                f"when it was saved ({fp} != {expected})"
            )


def _read(mgr: ocp.CheckpointManager, step: int, abstract: PyTree) -> PyTree:
    _quiet.install()  # a damaged step: one warning, not a traceback per failed read
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    args = ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)
    return mgr.restore(step, args=ocp.args.Composite(state=args))["state"]


def restore_state(
    mgr: ocp.CheckpointManager, step: int, leaves: list[LeafInfo], target: PyTree | None
) -> PyTree:
    """Restores the ``state`` item of ``step`` into ``target``'s form (see module doc)."""
    by_path = {info.path: info for info in leaves}
    if target is None:
        meta = mgr.item_metadata(step)["state"]
        tree = getattr(meta, "tree", meta)
        abstract = jax.tree.map(lambda m: np.empty(tuple(m.shape), np.dtype(m.dtype)), tree)
        restored = _read(mgr, step, abstract)
        flat = _layout.flatten(restored)
        missing = [p for p, _ in flat if p not in by_path]
        if missing or len(flat) != len(leaves):
            raise CheckpointCorruptionError(
                f"the stored arrays do not match the manifest (e.g. {missing[:1]})"
            )
        _verify(flat, by_path, [True] * len(flat))

        def rewrap(kp: Any, v: Any) -> Any:
            impl = by_path[_layout.path_str(kp)].key_impl
            return jax.random.wrap_key_data(v, impl=impl) if impl else v

        return jax.tree_util.tree_map_with_path(rewrap, restored)

    flat_target, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [_layout.path_str(kp) for kp, _ in flat_target]
    pairs = [_abstract_leaf(x, by_path[p]) for p, (_, x) in zip(paths, flat_target, strict=True)]
    abstract = jax.tree.unflatten(treedef, [a for a, _ in pairs])
    restored = _read(mgr, step, abstract)
    values = jax.tree.leaves(restored)
    _verify(list(zip(paths, values, strict=True)), by_path, [c for _, c in pairs])
    out = [
        _finish_leaf(v, x, by_path[p])
        for p, v, (_, x) in zip(paths, values, flat_target, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)
