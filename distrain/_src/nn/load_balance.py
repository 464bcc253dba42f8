"""Causal load balancing: reorder the sequence once, in the input path.

With causal attention over a sequence split in ``C`` contiguous chunks, device ``i``'s
queries see only keys of chunks ``<= i``: device 0 has almost nothing to compute,
device ``C - 1`` everything, and the step waits for the slowest. Cut the sequence in
``2C`` chunks instead and give device ``i`` chunks ``i`` and ``2C - 1 - i``: each
device then holds one early and one late chunk, and the same share of visible
(query, key) pairs.

The reordering is a permutation of the sequence dimension applied to *every* leaf
that has one (tokens, targets, positions, segment ids, loss weights), before the
batch reaches the strategy::

    batch = dt.nn.load_balance(batch, axis_size=4)            # in the data pipeline
    # the step: dt.nn.dot_product_attention(..., positions=batch["positions"])

The loss of an LM is a mean over tokens, so it does not change; attention stays exact
because :func:`distrain.nn.dot_product_attention` masks by ``positions`` (they must
be in the batch and travel with the tokens). Rotary embeddings read the same
``positions``. :func:`load_balance_inverse` undoes it (e.g. for per-token outputs).
"""

from __future__ import annotations

from typing import Any, TypeVar, final

import jax
import numpy as np

__all__ = ["load_balance", "load_balance_inverse", "load_balance_order", "LoadBalance"]

Tree = TypeVar("Tree")


def load_balance_order(seq_len: int, axis_size: int) -> np.ndarray:
    """The permutation: position ``j`` of the reordered sequence holds token ``order[j]``.

    Raises:
      ValueError: ``axis_size < 1``, or ``seq_len`` not divisible by ``2 * axis_size``.

    Example:
      >>> dt.nn.load_balance_order(8, 2)      # chunks 0, 3 | 1, 2
      array([0, 1, 6, 7, 2, 3, 4, 5])
    """
    if isinstance(axis_size, bool) or not isinstance(axis_size, int) or axis_size < 1:
        raise ValueError(f"axis_size must be a positive int. Received: axis_size={axis_size!r}.")
    if seq_len % (2 * axis_size):
        raise ValueError(
            f"Load balancing over {axis_size} devices cuts the sequence in 2 x {axis_size} = "
            f"{2 * axis_size} chunks, but the sequence length {seq_len} is not divisible by "
            f"{2 * axis_size}. Use a sequence length that is a multiple of {2 * axis_size}."
        )
    chunks = np.arange(seq_len).reshape(2 * axis_size, -1)
    mirrored = [c for i in range(axis_size) for c in (chunks[i], chunks[2 * axis_size - 1 - i])]
    return np.concatenate(mirrored)


def _permute(tree: Tree, order: np.ndarray, seq_axis: int) -> Tree:
    def take(path: Any, x: Any) -> Any:
        shape = np.shape(x)
        if len(shape) <= seq_axis or shape[seq_axis] != order.size:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)!r} has shape {shape}: expected dimension "
                f"{seq_axis} of length {order.size} (the sequence). Pass only the leaves "
                "that have the sequence dimension."
            )
        if isinstance(x, np.ndarray):
            return np.take(x, order, axis=seq_axis)
        return jax.numpy.take(x, order, axis=seq_axis)

    return jax.tree_util.tree_map_with_path(take, tree)


def _seq_len(tree: Any, seq_axis: int) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError("load_balance needs at least one array leaf. Received an empty tree.")
    shape = np.shape(leaves[0])
    if len(shape) <= seq_axis:
        raise ValueError(
            f"The first leaf has shape {shape}, which has no dimension {seq_axis} (seq_axis)."
        )
    return int(shape[seq_axis])


def load_balance(tree: Tree, axis_size: int, *, seq_axis: int = 1) -> Tree:
    """Every leaf's sequence dimension reordered so device ``i`` of ``axis_size`` holds
    chunks ``i`` and ``2 * axis_size - 1 - i``.

    Args:
      tree: a batch (NumPy or JAX arrays), every leaf with the sequence at ``seq_axis``
        (``seq_axis=0`` for one example, as a grain ``map`` sees it).
      axis_size: the size of the ``"context"`` axis.
      seq_axis: the sequence dimension.

    Raises:
      ValueError: a length not divisible by ``2 * axis_size``; a leaf without that
        dimension or of another length.

    Example:
      >>> rows = {"tokens": np.arange(8)[None], "positions": np.arange(8)[None]}
      >>> dt.nn.load_balance(rows, 2)["positions"]
      array([[0, 1, 6, 7, 2, 3, 4, 5]])
    """
    order = load_balance_order(_seq_len(tree, seq_axis), axis_size)
    return _permute(tree, order, seq_axis)


def load_balance_inverse(tree: Tree, axis_size: int, *, seq_axis: int = 1) -> Tree:
    """Undoes :func:`load_balance` (the sequence back in its natural order)."""
    order = load_balance_order(_seq_len(tree, seq_axis), axis_size)
    return _permute(tree, np.argsort(order), seq_axis)


@final
class LoadBalance:
    """:func:`load_balance` as a per-example map for a grain pipeline
    (``dataset.map(dt.nn.LoadBalance(4))``): an example's leaves have the sequence
    first (``seq_axis=0``).

    Example:
      >>> dt.nn.LoadBalance(2)({"tokens": np.arange(8)})["tokens"]
      array([0, 1, 6, 7, 2, 3, 4, 5])
    """

    def __init__(self, axis_size: int, *, seq_axis: int = 0) -> None:
        load_balance_order(2 * max(int(axis_size), 1), axis_size)  # checks axis_size
        self.axis_size, self.seq_axis = axis_size, seq_axis

    def __call__(self, example: Tree) -> Tree:
        return load_balance(example, self.axis_size, seq_axis=self.seq_axis)

    def __repr__(self) -> str:
        return f"LoadBalance(axis_size={self.axis_size}, seq_axis={self.seq_axis})"
