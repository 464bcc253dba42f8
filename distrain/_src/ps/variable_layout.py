"""Where each variable lives: pieces of a params pytree on parameter servers.

The layout is computed once, from the initial params and the partitioner.
Each leaf is cut along axis 0 into the pieces the partitioner asks for (one
piece when there is no partitioner), and pieces go to the parameter servers
round-robin in leaf order, as TensorFlow places variables on its ``ps``
tasks. Workers use the layout to split a gradient pytree into per-server
messages (`split`) and to put a pulled parameter pytree back together
(`join`).

Example:
    >>> import numpy as np
    >>> from distrain.experimental.partitioners import FixedShardsPartitioner
    >>> params = {"w": np.zeros((4, 2), np.float32), "b": np.zeros(2, np.float32)}
    >>> layout = Layout.plan(params, num_ps=2, partitioner=FixedShardsPartitioner(2))
    >>> layout.describe()
    [("['b']", 0, None), ("['w']", 1, (0, 2)), ("['w']", 0, (2, 4))]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from distrain._src.pytree import PyTree


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece of one leaf: rows ``[start, stop)`` of axis 0, or all of it.

    Attributes:
        leaf: index of the leaf in the flattened params.
        shard: index of the parameter server holding the piece.
        rows: ``(start, stop)`` along axis 0, or None for the whole leaf.
    """

    leaf: int
    shard: int
    rows: tuple[int, int] | None


def _validate_partition(result: Any, path: str, shape: tuple[int, ...]) -> int:
    """Returns the number of pieces along axis 0 the partitioner asked for."""
    expected = (
        f"one positive count per axis ({len(shape)} axes, e.g. "
        f"{[2] + [1] * (len(shape) - 1) if shape else []}) with only axis 0 above 1"
    )
    try:
        counts = [int(c) for c in result]
    except TypeError:
        counts = None
    if counts is None or len(counts) != len(shape) or any(c < 1 for c in counts):
        raise ValueError(
            f"variable_partitioner produced no shards for variable {path} of shape {shape}: "
            f"expected {expected}. Received: {result!r}."
        )
    if any(c != 1 for c in counts[1:]):
        raise ValueError(
            f"variable_partitioner asked to split variable {path} of shape {shape} along an "
            f"axis other than 0: expected {expected}. Received: {result!r}."
        )
    if counts and counts[0] > shape[0]:
        raise ValueError(
            f"variable_partitioner asked for {counts[0]} pieces of variable {path}, which has "
            f"only {shape[0]} rows along axis 0. Received: {result!r}; return at most "
            f"{shape[0]}."
        )
    return counts[0] if counts else 1


class Layout:
    """Placement of every leaf piece of a params pytree on ``num_ps`` servers.

    Build it with `Layout.plan`; the constructor takes the plan's parts.
    """

    def __init__(
        self,
        treedef: jax.tree_util.PyTreeDef,
        paths: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[np.dtype],
        pieces: Sequence[Sequence[Piece]],
        num_ps: int,
    ):
        self.treedef = treedef
        self.paths = list(paths)
        self.shapes = list(shapes)
        self.dtypes = list(dtypes)
        self.pieces = [list(p) for p in pieces]
        self.num_ps = num_ps
        # Per server, the (leaf, piece) pairs it holds, in a fixed order: the
        # order of the arrays in every message to and from that server.
        self.by_shard: list[list[Piece]] = [[] for _ in range(num_ps)]
        for leaf_pieces in self.pieces:
            for piece in leaf_pieces:
                self.by_shard[piece.shard].append(piece)

    @classmethod
    def plan(
        cls,
        params: PyTree,
        num_ps: int,
        partitioner: Callable[[tuple[int, ...], np.dtype], Sequence[int]] | None = None,
    ) -> Layout:
        """Places ``params`` on ``num_ps`` servers.

        Args:
            params: pytree of arrays (numpy or jax) or numeric scalars.
            num_ps: number of parameter servers, at least 1.
            partitioner: callable ``(shape, dtype) -> counts per axis``, or
                None to keep every leaf whole.

        Returns:
            The layout.

        Raises:
            ValueError: for an empty pytree, a non-numeric leaf, or a
                partitioner result that is not one positive count per axis
                (only axis 0 above 1, at most the number of rows).
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        if not flat:
            raise ValueError(
                "create_variables expects a params pytree with at least one array. "
                f"Received: {params!r}."
            )
        paths, shapes, dtypes, pieces = [], [], [], []
        next_shard = 0
        for index, (keypath, leaf) in enumerate(flat):
            path = jax.tree_util.keystr(keypath)
            value = np.asarray(leaf)
            if not (np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
                raise ValueError(
                    f"create_variables expects numeric array leaves. Received: leaf {path} "
                    f"of dtype {value.dtype}."
                )
            shape = tuple(value.shape)
            count = 1
            if partitioner is not None:
                count = _validate_partition(partitioner(shape, value.dtype), path, shape)
            if count == 1:
                leaf_pieces = [Piece(index, next_shard % num_ps, None)]
                next_shard += 1
            else:
                # np.array_split's rule (first pieces one row larger), as TF does.
                bounds = np.cumsum(
                    [0] + [len(r) for r in np.array_split(np.arange(shape[0]), count)]
                )
                leaf_pieces = []
                for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
                    leaf_pieces.append(Piece(index, next_shard % num_ps, (int(start), int(stop))))
                    next_shard += 1
            paths.append(path)
            shapes.append(shape)
            dtypes.append(value.dtype)
            pieces.append(leaf_pieces)
        return cls(treedef, paths, shapes, dtypes, pieces, num_ps)

    @property
    def leaf_specs(self) -> list[jax.ShapeDtypeStruct]:
        """Shape and dtype of every leaf, in flattened order."""
        return [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]

    def describe(self) -> list[tuple[str, int, tuple[int, int] | None]]:
        """Returns ``(leaf path, server index, rows or None)`` for every piece."""
        return [(self.paths[p.leaf], p.shard, p.rows) for pieces in self.pieces for p in pieces]

    def split(self, leaves: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
        """Cuts flattened leaves into the per-server lists of pieces."""
        return [
            [
                leaves[p.leaf] if p.rows is None else leaves[p.leaf][p.rows[0] : p.rows[1]]
                for p in shard
            ]
            for shard in self.by_shard
        ]

    def join(self, per_shard: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
        """Puts per-server lists of pieces back into flattened leaves."""
        parts: list[list[tuple[int, np.ndarray]]] = [[] for _ in self.shapes]
        for shard, arrays in zip(self.by_shard, per_shard, strict=True):
            for piece, array in zip(shard, arrays, strict=True):
                parts[piece.leaf].append((0 if piece.rows is None else piece.rows[0], array))
        leaves = []
        for leaf_parts in parts:
            if len(leaf_parts) == 1:
                leaves.append(leaf_parts[0][1])
            else:
                leaf_parts.sort(key=lambda item: item[0])
                leaves.append(np.concatenate([a for _, a in leaf_parts], axis=0))
        return leaves

    def unflatten(self, leaves: Sequence[Any]) -> PyTree:
        """Builds the params pytree from flattened leaves."""
        return self.treedef.unflatten(list(leaves))
