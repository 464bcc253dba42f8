"""One fragment's outer step, as three pure functions over parameter pytrees.

DiLoCo's outer step takes the islands' parameters (a leading island axis on every leaf)
back to one global model and the islands back to it:

1. :func:`pseudo_gradient`: the mean over islands of ``global - island``, in float32,
   through a codec (``codecs.py``) when the islands send less than float32;
2. :func:`outer_update`: the outer optimizer's step on the global parameters, the
   pseudo-gradient as its gradient;
3. :func:`merge`: the islands after the sync, ``alpha * island + (1 - alpha) * global``.

Framework-free, as ``outer.py`` (which schedules them over a round): a strategy that
shards the island axis passes the collectives as ``gather`` / ``mean``.

Example:
  >>> g, islands = {"w": jnp.array(1.0)}, {"w": jnp.array([-5.0, -3.0])}
  >>> pg = pseudo_gradient(g, islands)                        # {"w": 5.0}
  >>> sgd = optax.sgd(2.0)
  >>> new, _ = outer_update(sgd, g, sgd.init(g), pg)          # {"w": 1 - 2 * 5}
  >>> merge(new, islands, 0.0)["w"]                           # every island at -9
  Array([-9., -9.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from distrain._src.islands.codecs import OuterDType, decode, encode
from distrain._src.pytree import PyTree

__all__ = ["Gather", "Mean", "Params", "accum_dtype", "merge", "outer_update", "pseudo_gradient"]

Params = Any
Gather = Callable[[PyTree], PyTree]
Mean = Callable[[PyTree], PyTree]


def accum_dtype(dtype: Any) -> Any:
    """The dtype the outer step computes in: float32, or the parameters' if wider."""
    return jnp.promote_types(dtype, jnp.float32)


def pseudo_gradient(
    global_params: Params,
    island_params: Params,
    *,
    outer_dtype: OuterDType = "float32",
    gather: Gather | None = None,
    mean: Mean | None = None,
) -> Params:
    """The mean over islands of ``global - island``, in float32 (the outer gradient).

    Args:
      global_params: the global parameters.
      island_params: the islands' parameters, the same structure with a leading island
        axis on every leaf.
      outer_dtype: the codec of what each island sends (``codecs.py``): with
        ``"float32"`` the islands' differences are averaged directly (an all-reduce);
        otherwise each island encodes its own difference per tensor, the encodings
        (island axis leading) pass through ``gather``, and each is decoded and the
        decoded values averaged in float32.
      gather: applied to the pytree of encodings (:class:`codecs.Encoded` leaves with
        the island axis) before decoding; identity by default. A strategy passes the
        all-gather over its island axis (e.g. a sharding constraint to replicated).
      mean: with ``"float32"``, the mean over the island axis of the stacked
        differences (a pytree; default ``jnp.mean(x, 0)`` per leaf); a strategy whose
        replicas hold one island each passes an all-reduce over its island axis.

    Returns:
      The pseudo-gradient, ``global_params``' structure, float32 leaves (wider if the
      parameters are).

    Example:
      >>> pseudo_gradient({"w": jnp.array(1.0)}, {"w": jnp.array([-5.0, -3.0])})
      {'w': Array(5., dtype=float32)}
    """

    def delta(g: jax.Array, local: jax.Array) -> jax.Array:
        dtype = accum_dtype(g.dtype)
        return g.astype(dtype)[None] - local.astype(dtype)

    deltas = jax.tree.map(delta, global_params, island_params)
    if outer_dtype == "float32":
        if mean is not None:
            return mean(deltas)
        return jax.tree.map(lambda x: jnp.mean(x, axis=0), deltas)
    leaves, treedef = jax.tree.flatten(deltas)
    encoded = [jax.vmap(partial(encode, outer_dtype=outer_dtype))(x) for x in leaves]
    if gather is not None:
        encoded = gather(encoded)
    means = [
        jnp.mean(jax.vmap(partial(decode, outer_dtype=outer_dtype, shape=x.shape[1:]))(e), 0)
        for x, e in zip(leaves, encoded, strict=True)
    ]
    return jax.tree.unflatten(treedef, means)


def outer_update(
    optimizer: optax.GradientTransformation,
    global_params: Params,
    opt_state: optax.OptState,
    pseudo_grad: Params,
) -> tuple[Params, optax.OptState]:
    """One step of ``optimizer`` on the global parameters, the pseudo-gradient as gradient.

    The pseudo-gradient is cast to each parameter's dtype first (an optimizer sees
    gradients of its parameters' dtype; keep the global parameters in float32).

    Example:
      >>> sgd = optax.sgd(2.0)
      >>> w = jnp.array(1.0)
      >>> outer_update(sgd, w, sgd.init(w), jnp.array(6.0))[0]    # 1 - 2 * 6
      Array(-11., dtype=float32)
    """
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), pseudo_grad, global_params)
    updates, opt_state = optimizer.update(grads, opt_state, global_params)
    return optax.apply_updates(global_params, updates), opt_state


def merge(global_params: Params, island_params: Params, alpha: float) -> Params:
    """The islands after a sync: ``alpha * island + (1 - alpha) * global``, per island.

    ``alpha = 0`` gives every island the global parameters bit for bit (cast to its
    dtype); ``alpha = 1`` leaves the islands as they are.

    Example:
      >>> merge({"w": jnp.array(-11.0)}, {"w": jnp.array([-5.0, -5.0])}, 0.5)
      {'w': Array([-8., -8.], dtype=float32)}
    """

    def leaf(g: jax.Array, local: jax.Array) -> jax.Array:
        if alpha == 0.0:
            return jnp.broadcast_to(g.astype(local.dtype)[None], local.shape)
        if alpha == 1.0:
            return local
        dtype = accum_dtype(g.dtype)
        mixed = alpha * local.astype(dtype) + (1.0 - alpha) * g.astype(dtype)[None]
        return mixed.astype(local.dtype)

    return jax.tree.map(leaf, global_params, island_params)
