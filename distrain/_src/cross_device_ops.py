"""How a replica's values are summed across replicas (``cross_device_ops``).

All choices give the same numbers (to float rounding); they differ in how the sum is
communicated, which matters for many small gradients or slow links.

Example:
  >>> strategy = dt.MirroredStrategy(cross_device_ops=dt.HierarchicalCopyAllReduce(num_packs=1))
"""

from __future__ import annotations

import abc
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distrain._src.validate import positive_int


class CrossDeviceOps(abc.ABC):
    """Base class: ``all_sum(tree, axis_name)`` inside a replica function."""

    @abc.abstractmethod
    def all_sum(self, tree: Any, axis_name: str) -> Any:
        """Returns ``tree`` summed over ``axis_name``; called per replica."""


class _Psum(CrossDeviceOps):
    """One ``psum`` of the whole tree; JAX picks the transport (NCCL, ICI, gloo)."""

    def all_sum(self, tree: Any, axis_name: str) -> Any:
        return jax.lax.psum(tree, axis_name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@typing.final
class AllReduce(_Psum):
    """One ``psum`` of the whole tree (the default; NCCL/ICI/gloo all-reduce)."""


@typing.final
class NcclAllReduce(_Psum):
    """``tf.distribute.NcclAllReduce``'s name for :class:`AllReduce`.

    JAX picks the transport (NCCL on GPU, gloo on CPU), so this is the same algorithm.
    """


class ReductionToOneDevice(CrossDeviceOps):
    """Gathers every replica's value, then reduces it locally (no all-reduce primitive).

    Moves ``N`` times more data than an all-reduce; useful where all-reduce is
    unavailable or to debug a collective. Same numbers as :class:`AllReduce` up to the
    summation order.
    """

    def all_sum(self, tree: Any, axis_name: str) -> Any:
        return jax.tree.map(
            lambda x: jnp.sum(jax.lax.all_gather(x, axis_name, axis=0), axis=0).astype(x.dtype),
            tree,
        )

    def __repr__(self) -> str:
        return "ReductionToOneDevice()"


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Packs all leaves of a dtype into ``num_packs`` flat buffers, all-reduces those.

    Many small gradients then cost ``num_packs`` collectives instead of one each.

    Args:
      num_packs: number of buffers per dtype (>= 1).
    """

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = positive_int("num_packs", num_packs)

    def all_sum(self, tree: Any, axis_name: str) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        out: list[Any] = [None] * len(leaves)
        by_dtype: dict[Any, list[int]] = {}
        for i, leaf in enumerate(leaves):
            by_dtype.setdefault(jnp.result_type(leaf), []).append(i)
        for idx in by_dtype.values():
            flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
            chunks = jnp.array_split(flat, min(self.num_packs, flat.size))
            flat = jnp.concatenate([jax.lax.psum(c, axis_name) for c in chunks])
            offsets = np.cumsum([0] + [int(np.size(leaves[i])) for i in idx])
            for j, i in enumerate(idx):
                out[i] = flat[offsets[j] : offsets[j + 1]].reshape(jnp.shape(leaves[i]))
        return jax.tree.unflatten(treedef, out)

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_packs={self.num_packs})"


def resolve(cross_device_ops: CrossDeviceOps | None) -> CrossDeviceOps:
    """The given ops, or :class:`AllReduce`; raises for anything that is not ``CrossDeviceOps``."""
    if cross_device_ops is None:
        return AllReduce()
    if not isinstance(cross_device_ops, CrossDeviceOps):
        raise TypeError(
            "`cross_device_ops` must be a dt.CrossDeviceOps (dt.AllReduce(), "
            "dt.ReductionToOneDevice(), dt.HierarchicalCopyAllReduce()). "
            f"Received: {cross_device_ops!r}."
        )
    return cross_device_ops
