"""One process's copy in the local checkpoint tier: its bytes, its manifest, its checks.

A copy holds a process's addressable shards (one per distinct shard), laid end to end
in ``arrays.bin``, and a ``manifest.json`` that says where each shard's bytes are, on
which devices it lives and its CRC-32, with the data position and the trainer's
progress. A step directory is written under a temporary name and renamed when
complete; a copy that does not verify raises ``ValueError``. :func:`unpack` places a
copy onto a target whose layout :func:`layout_difference` found unchanged.

Example:
  >>> manifest, chunks = pack(7, state, None, None)
  >>> write_step(directory, 7, manifest, chunks, keep=2)
  >>> state = unpack(read_copy(directory / "7"), target)
"""

from __future__ import annotations

import json
import shutil
import uuid
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from distrain._src.checkpoint import _layout, _restore
from distrain._src.checkpoint._layout import LeafInfo
from distrain._src.pytree import PyTree

__all__ = [
    "FORMAT",
    "Copy",
    "from_blob",
    "head_bytes",
    "layout_difference",
    "pack",
    "read_copy",
    "saved_steps",
    "try_read",
    "unpack",
    "verify",
    "write_step",
]

FORMAT = "distrain.local/1"


def shard_index(idx: tuple[slice, ...] | None, shape: Sequence[int]) -> list[list[int]]:
    assert idx is not None  # addressable shards and device index maps always have one
    return [list(s.indices(n)[:2]) for s, n in zip(idx, shape, strict=True)]


def pack(step: int, state: PyTree, data_json: Any, meta_json: Any) -> tuple[dict, list[np.ndarray]]:
    """This process's part of ``state``: a manifest and the chunks it describes."""
    _, leaves = _layout.to_storable(state)
    entries: list[dict[str, Any]] = []
    pending: list[tuple[dict[str, Any], Any]] = []  # (shard entry, device buffer)
    for path, value, impl in leaves:
        shape, dtype = _layout.leaf_shape_dtype(value)
        entry: dict[str, Any] = {
            "path": path,
            "shape": list(shape),
            "dtype": np.dtype(dtype).name,
            "key_impl": impl,
            "shards": [],
        }
        if isinstance(value, jax.Array):
            by_index: dict[str, dict[str, Any]] = {}
            for shard in value.addressable_shards:
                index = shard_index(shard.index, shape)
                key = json.dumps(index)
                if key not in by_index:
                    by_index[key] = {"index": index, "devices": []}
                    pending.append((by_index[key], shard.data))
                by_index[key]["devices"].append(shard.device.id)
            entry["shards"] = list(by_index.values())
        else:
            whole = {"index": None, "devices": None}
            entry["shards"] = [whole]
            pending.append((whole, np.asarray(value, dtype)))
        entries.append(entry)
    # One transfer for every shard (waits for the steps that produce them).
    host = jax.device_get([buf for _, buf in pending])
    chunks, offset = [], 0
    for (shard, _), data in zip(pending, host, strict=True):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # bfloat16 has no buffer
        shard.update(offset=offset, nbytes=data.nbytes, crc32=zlib.crc32(data.data))
        offset += data.nbytes
        chunks.append(data)
    manifest = {
        "format": FORMAT,
        "step": step,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "leaves": entries,
        "data_state": data_json,
        "metadata": meta_json,
    }
    return manifest, chunks


def head_bytes(manifest: dict) -> np.ndarray:
    """The bytes that precede the arrays in an exchange: length, then the manifest."""
    head = json.dumps(manifest).encode()
    return np.frombuffer(len(head).to_bytes(8, "little") + head, np.uint8)


def from_blob(blob: np.ndarray) -> tuple[dict, memoryview]:
    """The manifest and the arrays of bytes that :func:`head_bytes` and the arrays made."""
    n = int.from_bytes(blob[:8].tobytes(), "little")
    return json.loads(blob[8 : 8 + n].tobytes()), blob[8 + n :].data


def write_step(parent: epath.Path, step: int, manifest: dict, data: Any, keep: int) -> None:
    """Writes one step directory atomically and deletes the oldest beyond ``keep``."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{step}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    with open(tmp / "arrays.bin", "wb") as f:
        for part in data:
            f.write(part)
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    final = parent / str(step)
    if final.exists():  # a copy of the same step written by an earlier attempt
        shutil.rmtree(final)
    tmp.rename(final)
    for old in saved_steps(parent)[:-keep]:
        shutil.rmtree(parent / str(old), ignore_errors=True)


def saved_steps(parent: epath.Path) -> list[int]:
    """The steps saved under ``parent``, oldest first."""
    if not parent.exists():
        return []
    return sorted(int(p.name) for p in parent.iterdir() if p.name.isdigit() and p.is_dir())


class Copy(NamedTuple):
    """A copy read back: its manifest and the bytes of its shards."""

    manifest: dict
    arrays: memoryview


def read_copy(where: epath.Path) -> Copy:
    """Reads and verifies one step directory (raises ValueError on any damage)."""
    try:
        manifest = json.loads((where / "manifest.json").read_text())
        arrays = memoryview((where / "arrays.bin").read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from e
    try:
        verify(manifest, arrays)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"its manifest is malformed ({type(e).__name__}: {e})") from e
    return Copy(manifest, arrays)


def try_read(where: epath.Path) -> Copy | None:
    """:func:`read_copy`, or None where it would raise."""
    try:
        return read_copy(where)
    except ValueError:
        return None


def verify(manifest: dict, arrays: memoryview) -> None:
    """Raises ValueError unless ``arrays`` hold the bytes ``manifest`` describes."""
    if manifest.get("format") != FORMAT:
        raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
    for leaf in manifest["leaves"]:
        for shard in leaf["shards"]:
            lo, n = shard["offset"], shard["nbytes"]
            if lo + n > len(arrays) or zlib.crc32(arrays[lo : lo + n]) != shard["crc32"]:
                raise ValueError(f"the bytes of leaf {leaf['path']!r} fail their CRC-32")


def layout_difference(manifest: dict, target: PyTree) -> str | None:
    """Why ``manifest`` cannot be placed onto ``target`` as saved (None: it can)."""
    if manifest["process_count"] != jax.process_count():
        return f"saved by {manifest['process_count']} processes, restoring on {jax.process_count()}"
    saved = {leaf["path"]: leaf for leaf in manifest["leaves"]}
    flat = _layout.flatten(target)
    if sorted(saved) != sorted(p for p, _ in flat):
        return "the state's leaves differ"
    for path, x in flat:
        leaf = saved[path]
        shape = tuple(leaf["shape"])
        target_shape, dtype = _layout.leaf_shape_dtype(x)
        if tuple(target_shape) != shape or jnp.dtype(dtype) != jnp.dtype(leaf["dtype"]):
            was, now = f"{leaf['dtype']}{list(shape)}", f"{dtype}{list(target_shape)}"
            return f"leaf {path!r} is {was} saved, {now} now"
        sharding = _restore.stored_sharding(x)
        if sharding is None:
            if leaf["shards"][0]["devices"] is not None:
                return f"leaf {path!r} was a device array, the target holds a host value"
            continue
        held = {
            (d, json.dumps(s["index"]))
            for s in leaf["shards"]
            if s["devices"]
            for d in s["devices"]
        }
        for device, idx in sharding.addressable_devices_indices_map(shape).items():
            d: Any = device
            if (d.id, json.dumps(shard_index(idx, shape))) not in held:
                return f"leaf {path!r} is placed differently (device {d.id})"
    return None


def unpack(copy: Copy, target: PyTree) -> PyTree:
    """The state of ``copy`` placed like ``target`` (whose layout was checked)."""
    saved = {leaf["path"]: leaf for leaf in copy.manifest["leaves"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    out = []
    for kp, x in flat:
        leaf = saved[_layout.path_str(kp)]
        shape, dtype = tuple(leaf["shape"]), jnp.dtype(leaf["dtype"])
        sharding = _restore.stored_sharding(x)
        value: Any
        if sharding is None:
            value = _chunk(copy, leaf["shards"][0], dtype, shape).copy()
        else:
            by_index = {json.dumps(s["index"]): s for s in leaf["shards"] if s["index"] is not None}
            buffers = []
            for device, idx in sharding.addressable_devices_indices_map(shape).items():
                index = shard_index(idx, shape)
                part = _chunk(copy, by_index[json.dumps(index)], dtype, [b - a for a, b in index])
                buffers.append(jax.device_put(part, device))
            value = jax.make_array_from_single_device_arrays(shape, sharding, buffers)
        info = LeafInfo(_layout.path_str(kp), shape, dtype.name, leaf["key_impl"], None)
        out.append(_restore._finish_leaf(value, x, info))
    return jax.tree.unflatten(treedef, out)


def _chunk(copy: Copy, shard: dict[str, Any], dtype: Any, shape: Sequence[int]) -> np.ndarray:
    """One stored shard of ``copy`` as an array (a view of its bytes)."""
    raw = copy.arrays[shard["offset"] : shard["offset"] + shard["nbytes"]]
    return np.frombuffer(raw, dtype).reshape(shape)
