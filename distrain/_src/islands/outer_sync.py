"""The outer step's collectives under ``DiLoCoStrategy``: what crosses islands.

Inside an island the replicas hold the same state (a step's gradients are all-reduced
over the island's replicas), so each holds the same difference ``global - island``.
Two ways to exchange it, ``outer_sync``:

* ``"flat"``: every replica sends its whole copy across islands: one all-reduce over
  ``"island"`` of the concatenated float32 differences (or one all-gather of the
  encodings' bytes with a quantized ``outer_dtype``). With R replicas per island the
  slow link carries R copies of the model per sync.
* ``"hierarchical"`` (the default): each replica sends only its 1/R share of the
  island's copy (the same bytes, zero-padded to a multiple of R) across islands, then
  the replicas of an island all-gather the reduced shares over ``"replica"`` (the
  island's fast link). The slow link carries one copy of the model (or of its
  encoding) per island, whatever R. No reduction inside the island is needed: its
  replicas' copies are equal, so a slice of one is the island's share.

With replicas that span devices (``devices_per_replica``), a float32 share is split
over the replica's devices too, so one copy per island still crosses; an encoding's
share is not (each device of a replica sends it: R times fewer bytes than flat, not
R x devices_per_replica).

Both give the same values, bit for bit: every element is reduced (or gathered) over
the same islands in the same way, only split differently over the devices.

An outer step exchanges one buffer per stage, in one collective: XLA:CPU may run
independent collectives of a program in a different order on different devices, and
with several of them the cross-island ones deadlocked (the LM of
``benchmarks/islands.py``, 4 islands: "Expected 4 threads to join the rendezvous, but
only 2 of them arrived"). The hierarchical stages depend on each other, so they run in
order on every device.

Example:
  >>> mean, gather = exchange("hierarchical", replicas=2)
  >>> outer.pseudo_gradient(global_params, island_params, mean=mean)  # in a replica
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distrain._src import context

OuterSync = Literal["hierarchical", "flat"]
OUTER_SYNCS: tuple[OuterSync, ...] = ("hierarchical", "flat")
ISLAND_AXIS = "island"


def check_outer_sync(value: Any) -> OuterSync:
    """``value`` if it names an outer sync, else a ``ValueError``.

    Example:
      >>> check_outer_sync("flat")
      'flat'
    """
    if value not in OUTER_SYNCS:
        raise ValueError(
            f"outer_sync must be one of {list(OUTER_SYNCS)}. Received: outer_sync={value!r}."
        )
    return value


def exchange(
    outer_sync: OuterSync, replicas: int, inner: tuple[str, ...] = ()
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """The ``mean`` and ``gather`` hooks of :func:`outer.pseudo_gradient` for a replica
    of an island of ``replicas`` replicas, each of the devices on the ``inner`` axes
    (flat when ``replicas`` is 1: nothing to split, and XLA rejects a collective over a
    manual axis of size 1 beside automatic ones).

    Example:
      >>> mean, gather = exchange("flat", replicas=4)
    """
    share = replicas if outer_sync == "hierarchical" else 1
    return (
        functools.partial(mean_over_islands, replicas=share, inner=inner),
        functools.partial(gather_islands, replicas=share, inner=inner),
    )


def mean_over_islands(deltas: Any, *, replicas: int = 1, inner: tuple[str, ...] = ()) -> Any:
    """The mean over islands of this island's differences (an island axis of 1 on every
    leaf): one all-reduce of their concatenation over ``"island"``, of this replica's
    1/``replicas`` share of it when ``replicas > 1`` (then all-gathered in the island).

    Example:
      >>> mean_over_islands({"w": delta[None]}, replicas=2)    # inside a replica of run
    """
    leaves, treedef = jax.tree.flatten(deltas)
    flat = jnp.concatenate([x[0].ravel() for x in leaves])
    if replicas == 1:
        mean = jax.lax.pmean(flat, ISLAND_AXIS)
    else:
        share = jax.lax.pmean(_share(flat, replicas, inner), ISLAND_AXIS)
        mean = _whole(share)[: flat.size]
    out, start = [], 0
    for x in leaves:
        size = x[0].size
        out.append(mean[start : start + size].reshape(x.shape[1:]).astype(x.dtype))
        start += size
    return jax.tree.unflatten(treedef, out)


def gather_islands(encoded: Any, *, replicas: int = 1, inner: tuple[str, ...] = ()) -> Any:
    """Every island's encodings (island axis first), from this island's (an island axis
    of 1): their bytes concatenated and all-gathered over ``"island"`` at once (this
    replica's 1/``replicas`` share of them when ``replicas > 1``, then all-gathered in
    the island). As bytes, a bfloat16 payload moves 2 bytes a value (XLA:CPU widens a
    bfloat16 all-gather to float32).

    Example:
      >>> gather_islands([Encoded(codes[None], scale[None])], replicas=2)   # in a replica
    """
    leaves, treedef = jax.tree.flatten(encoded)
    parts = [jax.lax.bitcast_convert_type(x[0].ravel(), jnp.uint8).ravel() for x in leaves]
    flat = jnp.concatenate(parts)
    if replicas == 1:
        gathered = jax.lax.all_gather(flat, ISLAND_AXIS)  # [islands, bytes]
    else:
        shares = jax.lax.all_gather(_share(flat, replicas, inner), ISLAND_AXIS)  # [islands, share]
        gathered = _whole(shares, axis=1)[:, : flat.size]
    out, start = [], 0
    for x, part in zip(leaves, parts, strict=True):
        raw = gathered[:, start : start + part.size]
        start += part.size
        width = x.dtype.itemsize
        raw = raw.reshape(raw.shape[0], -1, width) if width > 1 else raw
        values = jax.lax.bitcast_convert_type(raw, x.dtype)
        out.append(values.reshape(raw.shape[0], *x.shape[1:]))
    return jax.tree.unflatten(treedef, out)


def _replica_context() -> context.ReplicaContext:
    ctx = context.get_replica_context()
    if ctx is None or ctx.axis_name is None:
        raise RuntimeError(
            "The hierarchical outer sync runs inside a replica of DiLoCoStrategy.run; "
            "it was called outside one. Call it from the strategy's inner step, or use "
            "replicas=1."
        )
    return ctx


def _share(flat: jax.Array, replicas: int, inner: tuple[str, ...]) -> jax.Array:
    """This replica's 1/``replicas`` of ``flat`` (zero-padded to a multiple of it), split
    over the replica's own devices (``inner`` axes) too."""
    size = -(-flat.size // replicas)
    padded = jnp.pad(flat, (0, size * replicas - flat.size))
    index = _replica_context().replica_id_in_sync_group
    share = jax.lax.dynamic_slice_in_dim(padded, index * size, size)
    if inner:
        share = jax.lax.with_sharding_constraint(share, P(inner))
    return share


def _whole(share: jax.Array, axis: int = 0) -> jax.Array:
    """The island's replicas' shares, concatenated along ``axis`` in replica order."""
    return _replica_context().all_gather(share, axis=axis)
