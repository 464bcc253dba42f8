"""What a checkpoint holds besides the arrays: the leaf manifest and JSON payloads.

A distrain checkpoint step is one orbax step directory with three items:

* ``state``: the pytree of arrays (orbax ``PyTreeSave``). Typed PRNG keys are
  stored as their raw ``uint32`` key data (``jax.random.key_data``) because orbax
  cannot serialise key dtypes.
* ``data``: ``{"data_state": ...}``, the input pipeline position (JSON).
* ``meta``: ``{"metadata": ..., "manifest": ...}`` (JSON): the trainer's progress and
  anything else the caller passes, and the manifest: the format version and one entry
  per leaf of ``state`` with its path, shape, dtype, PRNG implementation (for keys)
  and content fingerprint. Restore checks a target against it (clear errors for
  incompatible models) and verifies the data read back against the fingerprints
  (detects garbled files).

Leaf paths are written ``params/dense/kernel``: dictionary keys, attribute names
and sequence indices joined with ``/``, so a state saved from a ``TrainState``
matches a target that is a plain nested dict with the same names.

Nothing is ever pickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from distrain._src import pytree
from distrain._src.pytree import PyTree

FORMAT = "distrain.checkpoint/1"


class CheckpointCorruptionError(RuntimeError):
    """A checkpoint step could not be read back intact (truncated or garbled files)."""


def path_str(keypath: Sequence[Any]) -> str:
    """``params/w`` for ``(DictKey('params'), GetAttrKey('w'))`` (``pytree.path_str``);
    ``<root>`` for a leaf that is the whole tree."""
    return pytree.path_str(keypath) or "<root>"


def is_prng_key(x: Any) -> bool:
    """Whether ``x`` (an array or ShapeDtypeStruct) has a typed PRNG key dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a leaf as stored (key data for typed keys)."""
    if is_prng_key(x):
        sds = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return tuple(sds.shape), np.dtype(sds.dtype)
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
        return tuple(x.shape), np.dtype(x.dtype)
    if isinstance(x, bool | int | float | complex):
        a = np.asarray(x)
        return tuple(a.shape), a.dtype
    raise TypeError(
        "A checkpointed state may only hold arrays (jax, NumPy), PRNG keys and Python "
        f"numbers. Received a leaf of type {type(x).__name__}. Put other values in "
        "`metadata=` (JSON) instead."
    )


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One manifest entry."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    key_impl: str | None
    fingerprint: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "key_impl": self.key_impl,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeafInfo:
        if set(d) != _LEAF_KEYS:
            raise CheckpointCorruptionError(f"malformed manifest entry {dict(d)!r:.200}")
        return cls(
            path=str(d["path"]),
            shape=tuple(int(s) for s in d["shape"]),
            dtype=str(np.dtype(d["dtype"])),
            key_impl=d["key_impl"],
            fingerprint=d["fingerprint"],
        )


_LEAF_KEYS = {"path", "shape", "dtype", "key_impl", "fingerprint"}


def seal(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` plus a checksum of its JSON form, checked by :func:`unseal`.

    Orbax stores JSON items as plain files; a garbled byte can leave valid JSON with
    different content (a renamed key, another digit), which only a checksum notices.
    """
    return {**payload, "checksum": _checksum(payload)}


def unseal(item: Any, what: str) -> dict[str, Any]:
    """The payload of a sealed JSON item; CheckpointCorruptionError if it was altered."""
    if not isinstance(item, dict) or "checksum" not in item:
        raise CheckpointCorruptionError(f"the {what} item has no checksum")
    payload = {k: v for k, v in item.items() if k != "checksum"}
    if _checksum(payload) != item["checksum"]:
        raise CheckpointCorruptionError(f"the {what} item does not match its checksum")
    return payload


def _checksum(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def flatten(tree: PyTree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs in pytree order (typed keys are leaves)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(kp), leaf) for kp, leaf in flat]


def to_storable(state: PyTree) -> tuple[PyTree, list[tuple[str, Any, str | None]]]:
    """Replaces typed PRNG keys by their key data; returns the tree and its leaves.

    Each leaf comes back as ``(path, stored_value, key_impl_or_None)``.
    """
    leaves: list[tuple[str, Any, str | None]] = []

    def convert(kp: Any, x: Any) -> Any:
        leaf_shape_dtype(x)  # raises a clear TypeError for unsupported leaves
        if is_prng_key(x):
            impl = str(jax.random.key_impl(x))
            data = jax.random.key_data(x)
            leaves.append((path_str(kp), data, impl))
            return data
        leaves.append((path_str(kp), x, None))
        return x

    stored = jax.tree_util.tree_map_with_path(convert, state)
    seen: dict[str, int] = {}
    for p, _, _ in leaves:
        seen[p] = seen.get(p, 0) + 1
    dup = [p for p, n in seen.items() if n > 1]
    if dup:
        raise ValueError(
            f"Expected every leaf of the state to have a distinct path; {dup[0]!r} occurs "
            f"{seen[dup[0]]} times (keys that differ only in type, e.g. 1 and '1'). "
            "Rename the keys."
        )
    return stored, leaves


def check_compatible(saved: Sequence[LeafInfo], target: PyTree, where: str) -> None:
    """Raises ValueError naming the first leaf where ``target`` and ``saved`` disagree
    (a missing or extra leaf, another shape, or a dtype that would truncate the values)."""
    by_path = {leaf.path: leaf for leaf in saved}
    target_paths = set()
    for path, x in flatten(target):
        target_paths.add(path)
        shape, dtype = leaf_shape_dtype(x)
        info = by_path.get(path)
        if info is None:
            raise ValueError(
                f"The checkpoint {where} does not match the restore target: the target has "
                f"a leaf at {path!r} with shape {shape}, the checkpoint has no leaf there. "
                "Pass a target built like the state that was saved (same model and "
                "optimizer), or restore without a target to inspect the checkpoint."
            )
        if info.shape != shape:
            raise ValueError(
                f"The checkpoint {where} does not match the restore target: at {path!r} "
                f"the checkpoint has shape {info.shape} ({info.dtype}), the target has "
                f"shape {shape}. Pass a target built like the state that was saved (same "
                "model and optimizer), or use a new checkpoint directory."
            )
        saved_dtype = np.dtype(info.dtype)
        # Casting within a kind (float32 -> bfloat16, int64 -> int32) or up a kind
        # (int -> float) keeps the values' meaning; float -> int, complex -> float or
        # number -> bool would silently truncate them.
        if not is_prng_key(x) and not np.can_cast(saved_dtype, dtype, "same_kind"):
            raise ValueError(
                f"The checkpoint {where} does not match the restore target: at {path!r} "
                f"the checkpoint holds {saved_dtype.name} values, the target is "
                f"{np.dtype(dtype).name}; casting would truncate them. Give the target "
                f"leaf the dtype {saved_dtype.name} (or another {saved_dtype.kind!r}-kind "
                "dtype) and convert after restoring if you mean to."
            )
    for info in saved:
        if info.path not in target_paths:
            raise ValueError(
                f"The checkpoint {where} does not match the restore target: the checkpoint "
                f"has a leaf at {info.path!r} with shape {info.shape}, the target has no "
                "leaf there. Pass a target built like the state that was saved (same model "
                "and optimizer), or restore without a target to inspect the checkpoint."
            )


def to_json(value: Any, where: str) -> Any:
    """A JSON-ready copy of ``value`` (NumPy/JAX scalars and arrays become numbers/lists).

    Raises:
      TypeError: for values JSON cannot hold, naming where they are.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"__float__": repr(value)}  # JSON has no NaN/inf; keep them exactly
        return value
    if isinstance(value, np.generic | np.ndarray | jax.Array):
        if is_prng_key(value):
            raise TypeError(
                f"{where} holds a typed PRNG key. Put keys in the state (they are saved as "
                "arrays), or pass jax.random.key_data(key).tolist()."
            )
        return to_json(np.asarray(value).tolist(), where)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"{where} must have string keys (it is stored as JSON); received key "
                    f"{k!r} of type {type(k).__name__}. Convert the key to str."
                )
            out[k] = to_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where} must be JSON-compatible (dict, list, str, numbers, bool, None, NumPy "
        f"scalars/arrays); received a {type(value).__name__}. Convert it, e.g. to a dict "
        "of numbers."
    )


def from_json(value: Any) -> Any:
    """Inverse of the non-finite float encoding of :func:`to_json`."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value
