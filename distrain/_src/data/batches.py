"""What makes a batch acceptable, and the messages that say why one is not.

Every batch a distributed dataset places is checked here first: numeric leaves, one
leading (batch) dimension shared by every leaf, rows that divide over the replicas.
``BatchShaper`` applies the ``InputOptions`` of one pass: a final partial batch is
dropped (``drop_remainder``) or padded with a mask (``mask_key``), and TensorFlow's
unbatched per-replica elements are stacked one per replica. The checks for whole arrays
passed where batches are expected (``whole_arrays_error``) live here too: the Trainer
and ``experimental_distribute_dataset`` share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, final

import jax
import numpy as np

from distrain._src.data.options import InputOptions, multiples
from distrain._src.padding import pad_rows

# A batch ready to place: its leaves, its structure and its rows.
Flat = tuple[list[Any], Any, int]


def leaf_paths(leaves: list[Any], treedef: Any) -> list[str]:
    """Each leaf's key path (``"['x']"``), for error messages."""
    return [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(treedef.unflatten(leaves))
    ]


def _shapes(leaves: list[Any], treedef: Any) -> dict[str, tuple[int, ...]]:
    return {p: tuple(np.shape(x)) for p, x in zip(leaf_paths(leaves, treedef), leaves, strict=True)}


def check_dtypes(leaves: list[Any], treedef: Any) -> None:
    """Refuses leaves that cannot go to a device (strings, objects), naming the key."""
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            continue  # already on a device
        dtype = np.asarray(x).dtype if getattr(x, "dtype", None) is None else np.dtype(x.dtype)
        if not (jax.dtypes.issubdtype(dtype, np.number) or dtype == np.bool_):
            path = leaf_paths(leaves, treedef)[i] or "the batch"
            raise TypeError(
                f"Batch leaf {path} has dtype {dtype}; only numeric and bool arrays can be "
                "placed on the devices. Drop that key from the batches, or encode it as "
                "numbers (e.g. token or label ids) before batching."
            )


def _rows(x: Any) -> int | None:
    """Leading dimension of a leaf (None for a scalar); ``.shape`` first: np.shape's
    dispatch costs more than the rest of a step's input checks on a fast path."""
    shape = x.shape if hasattr(x, "shape") else np.shape(x)
    return int(shape[0]) if len(shape) else None


def batch_size(leaves: list[Any], treedef: Any) -> int:
    """The rows of a flattened batch; refuses a scalar leaf, leaves that disagree and no rows."""
    sizes = {_rows(x) for x in leaves}
    if None in sizes:  # a scalar leaf: no batch dimension
        shapes = _shapes(leaves, treedef)
        scalars = [p or "(the batch itself)" for p, s in shapes.items() if s == ()]
        raise ValueError(
            f"Batch leaf {', '.join(scalars)} has no batch dimension (shape ()): every leaf "
            f"of a batch needs a leading dimension of rows. Received shapes: {shapes}. "
            "Batch the data first (e.g. dt.data.ArrayPipeline(..., global_batch_size=B)). "
            "TensorFlow's distribute_datasets_from_function gives each replica one "
            "unbatched element: pass options=dt.InputOptions(per_replica_batches=True) "
            "there for the same."
        )
    size = sizes.pop() if len(sizes) == 1 else None
    if size is None:  # leaves disagree
        shapes = _shapes(leaves, treedef)
        raise ValueError(
            "Every leaf of a batch must have the same leading (batch) dimension. "
            f"Received shapes: {shapes}."
        )
    if size == 0:
        shapes = _shapes(leaves, treedef)
        raise ValueError(
            f"A batch has no rows (leading dimension 0; shapes {shapes}). Every batch needs at "
            "least one example: skip empty batches in the source (or fix what yields them)."
        )
    return size


def whole_arrays_error(data: Any) -> str | None:
    """Why ``data`` looks like whole arrays rather than an iterable of batches, or None.

    Whole arrays are a dict of arrays, one array, or a Keras-style tuple ``(x, y)`` /
    ``(x, y, sample_weight)`` of arrays with the same number of rows. Iterating them
    would yield keys, rows or whole arrays as "batches".
    """
    fix = (
        "wrap it as dt.data.ArrayPipeline({arg}, global_batch_size=B) to batch it (its "
        "batches have the same structure{what}): the Trainer and "
        "experimental_distribute_dataset take an iterable of batches, not whole arrays."
    )

    def rows(x: Any) -> int | None:
        shape = getattr(x, "shape", None)
        return int(shape[0]) if shape is not None and len(shape) >= 1 else None

    if isinstance(data, Mapping):
        leaves = list(data.values())
        if leaves and all(rows(v) is not None for v in leaves):
            counts = {r for r in map(rows, leaves) if r is not None}  # all are: checked above
            size = f"{counts.pop()} rows" if len(counts) == 1 else "rows " + str(sorted(counts))
            arg = "{" + ", ".join(f"{k!r}: ..." for k in data) + "}"
            return (
                "Received a dict of arrays: "
                + fix.format(arg=arg, what=": dicts")
                + (f" Received {size}, keys {list(data)}.")
            )
        return None
    if rows(data) is not None and not isinstance(data, list | tuple):
        return f"Received an array of {rows(data)} rows: " + fix.format(arg="x", what="")
    if isinstance(data, tuple) and 1 < len(data) <= 3:
        n = {rows(v) for v in data}
        if len(n) == 1 and None not in n:
            return (
                f"Received a tuple of {len(data)} whole arrays of {n.pop()} rows, read as "
                "Keras's (x, y) (or (x, y, sample_weight)): "
                + fix.format(
                    arg="(x, y)", what=": (x_batch, y_batch) tuples, passed to your step as a tuple"
                )
                + " If these are batches, pass them in a list."
            )
    return None


@dataclasses.dataclass
class Elements:
    """One step's unbatched elements, one per local replica (TF's per-replica form)."""

    parts: list[Any]


def is_unbatched(element: Any) -> bool:
    """Whether an element has a leaf without a batch dimension (a scalar)."""
    return any(np.ndim(x) == 0 for x in jax.tree.leaves(element))


@final
class BatchShaper:
    """One pass's batches checked and shaped by its ``InputOptions``.

    The first batch fixes the full size: a smaller (last) batch is dropped or padded,
    and every batch must divide over ``replicas`` (this process's replicas for
    process-local input, else all of them).

    Args:
      options: the dataset's options.
      replicas: the replicas a batch is split over.
      process_batches: batches are this process's rows on one of several processes
        (the messages then speak of "the batch size of this process").
      array_pipeline: the source is an ``ArrayPipeline``, which pads or drops itself
        (the messages then name its options).
    """

    def __init__(
        self, options: InputOptions, replicas: int, process_batches: bool, array_pipeline: bool
    ) -> None:
        self._options = options
        self._replicas = replicas
        self._process_batches = process_batches
        self._array_pipeline = array_pipeline
        self._full_size: int | None = None

    def prepare(self, batch: Any) -> Flat | None:
        """Validates one batch; pads/masks or drops a partial one. None means skip.

        Returns the batch to place as ``(leaves, treedef, rows)``: flattened and measured
        once per batch, here.
        """
        opts = self._options
        leaves, treedef = jax.tree.flatten(batch)
        check_dtypes(leaves, treedef)
        size = batch_size(leaves, treedef)
        if self._full_size is None:
            self._full_size = size
        full = self._full_size
        partial = size < full
        if partial and opts.drop_remainder:
            return None
        if opts.mask_key is not None:
            if not isinstance(batch, dict):
                raise TypeError(
                    "InputOptions(mask_key=...) needs dict batches so the mask can be added. "
                    f"Received a {type(batch).__name__}."
                )
            if size > full:
                raise ValueError(
                    f"A batch has {size} rows, more than the first batch ({full}). With "
                    "InputOptions(mask_key=...) every batch is padded to the first batch's "
                    "size, so the first batch must be the largest: yield batches of one size "
                    "(only the last one smaller), or drop mask_key."
                )
            if partial:
                return _pad(batch, size, full, opts.mask_key)  # `full` rows: divisible
        self._check_divisible(batch, size, full)
        if opts.mask_key is not None and opts.mask_key not in batch:
            return _pad(batch, size, full, opts.mask_key)  # adds the all-ones mask
        return leaves, treedef, size

    def _check_divisible(self, batch: Any, size: int, full: int) -> None:
        n = self._replicas
        if size % n == 0:
            return
        what = "batch size of this process" if self._process_batches else "global batch size"
        if size < full:
            # Name the options of what the user built: an ArrayPipeline pads or drops
            # itself; any other source is handled by the distributed dataset's options.
            pipe = "ArrayPipeline" if self._array_pipeline else None
            opts = f"{pipe}(..., " if pipe else "InputOptions("
            fixes = f"{opts}drop_remainder=True) to drop it"
            if isinstance(batch, dict):
                fixes += (
                    f", or {opts}mask_key='mask') to pad it to {full} rows with a mask "
                    "for dt.compute_average_loss(..., mask=batch['mask'])"
                )
            elif pipe:
                fixes += " (mask_key needs dict data: {'x': x, 'y': y} instead of (x, y))"
            raise ValueError(
                f"The last {what} ({size}) is smaller than the first ({full}) and not divisible "
                f"by the number of replicas ({n}). Pass {fixes}."
            )
        raise ValueError(
            f"The {what} ({size}) must be divisible by the number of replicas ({n}): "
            f"each replica gets an equal share. Use a batch size that is a multiple of {n} "
            f"(e.g. {multiples(size, n)})."
        )

    def stack(self, elements: list[Any], n_local: int) -> Flat | None:
        """One unbatched element per local replica, stacked (``None``: a short last
        group, dropped with ``drop_remainder``), flattened as ``prepare`` returns it."""
        if self._options.mask_key is not None:
            raise ValueError(
                "InputOptions(mask_key=...) pads partial batches, and unbatched elements "
                "(one per replica) have no rows to pad. Drop mask_key (a short last group "
                "is refused, or dropped with drop_remainder=True), or batch the elements."
            )
        if len(elements) < n_local:
            if self._options.drop_remainder:
                return None
            raise ValueError(
                f"The last step has {len(elements)} element(s) for this process's {n_local} "
                "replicas (one each). Pass InputOptions(drop_remainder=True) to drop them, "
                "as TensorFlow does, or yield a multiple of the local replica count."
            )
        leaves, treedef = jax.tree.flatten(elements[0])
        check_dtypes(leaves, treedef)
        columns = []
        for e in elements:
            e_leaves, e_tree = jax.tree.flatten(e)
            if e_tree != treedef:  # type: ignore[operator]
                raise ValueError(
                    "Unbatched elements must have one structure to go one per replica. "
                    f"Received {treedef} and {e_tree} in this step."
                )
            columns.append(e_leaves)
        stacked = []
        for i, path in enumerate(leaf_paths(leaves, treedef)):
            shapes = [np.shape(c[i]) for c in columns]
            if len(set(shapes)) > 1:
                raise ValueError(
                    f"Unbatched elements must have one shape per leaf to go one per replica. "
                    f"Leaf {path or '(the element)'} has shapes {shapes} in this step."
                )
            stacked.append(np.stack([np.asarray(c[i]) for c in columns]))
        return stacked, treedef, n_local


def _pad(batch: dict[str, Any], size: int, full: int, key: str) -> Flat:
    """``batch`` padded to ``full`` rows with the mask ``batch[key]`` (0.0 on padding),
    flattened as ``BatchShaper.prepare`` returns it."""
    keys = [k for k in batch if k != key]
    leaves, mask = pad_rows([batch[k] for k in keys], size, full, batch.get(key))
    padded = {**dict(zip(keys, leaves, strict=True)), key: mask}
    return (*jax.tree.flatten(padded), full)
