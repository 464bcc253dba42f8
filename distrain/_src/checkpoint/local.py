"""The local checkpoint tier: frequent saves to a node-local directory, mirrored on a peer.

A save writes each process's addressable shards (one copy per distinct shard), the
data position and the trainer's progress to ``<local>/process-<p>/<step>/`` (an
``arrays.bin`` and a ``manifest.json`` with a CRC-32 per shard), and sends the same
bytes to a peer process, which keeps them in ``<local>/process-<peer>/peer-of-<p>/<step>/``.
The peer is the nearest process on another host when there is one, so losing a
node's local directory loses nothing. A step directory is written under a temporary
name and renamed when complete: it either holds a whole copy or does not exist.

Restore (all processes together) picks the newest step for which every process has
a copy that verifies, its own or the one its peer holds; a copy whose checksum fails
is skipped with a one-line warning. A process without its own copy gets it back
from its peer. Shards are placed with ``jax.make_array_from_single_device_arrays``,
so the tier restores onto the same placement only: when the target's device layout
differs from the saved one (another device or process count, another sharding), the
tier is ignored, with a message, and the persistent checkpoints are used.

The bytes travel between processes by ``ppermute`` over a mesh of one device per
process (the accelerator network on GPUs and TPUs, gloo on CPU; nothing but JAX), in
chunks of ``CHUNK_BYTES``: a device holds one chunk and the one it receives, whatever
the state's size. No process ever fails alone in a collective of the tier: a
background write that failed raises on every process at the next save (naming the
process and why), and a process whose peer died (gloo's error, at once) or stopped
answering (after ``WAIT_SECONDS``) raises, saying so, instead of waiting forever.

This module is used by :class:`~distrain.checkpoint.CheckpointManager`
(``local_directory=``); it has no public entry point of its own.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import os
import shutil
import socket
import threading
import uuid
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distrain._src.checkpoint import _layout, _restore
from distrain._src.checkpoint._layout import LeafInfo
from distrain._src.pytree import PyTree
from distrain._src.validate import positive_int

FORMAT = "distrain.local/1"
_SLOTS = 8  # steps each process reports at restore (keep is at most this)
_MIB = 1 << 20
# Bytes per collective of the exchange: what it stages on a device, and receives,
# whatever the state's size (a whole state and as much received, before issue 50).
CHUNK_BYTES = 64 * _MIB
# Seconds a process waits for the others in one collective of the tier. A killed peer
# is noticed at once (gloo's error); this bounds one that froze, lost its host or is
# stuck (a slow disk), which would otherwise hold the others until JAX's heartbeat
# timeout aborts them, or forever if it still sends heartbeats.
WAIT_SECONDS = 600.0
_MESSAGE_BYTES = 512  # of a failed write's message, sent to every process
_T = TypeVar("_T")


class LocalRestore(NamedTuple):
    """A state read back from the local tier."""

    step: int
    state: PyTree
    data_state: Any
    metadata: Any
    from_peer: tuple[int, ...]  # processes whose copy came from their peer


# ---------------------------------------------------------------- serialising
def _index(idx: tuple[slice, ...] | None, shape: Sequence[int]) -> list[list[int]]:
    assert idx is not None  # addressable shards and device index maps always have one
    return [list(s.indices(n)[:2]) for s, n in zip(idx, shape, strict=True)]


def _pack(
    step: int, state: PyTree, data_json: Any, meta_json: Any
) -> tuple[dict, list[np.ndarray]]:
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
                index = _index(shard.index, shape)
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


def _head(manifest: dict) -> np.ndarray:
    """The bytes that precede the arrays in an exchange: length, then the manifest."""
    head = json.dumps(manifest).encode()
    return np.frombuffer(len(head).to_bytes(8, "little") + head, np.uint8)


def _from_blob(blob: np.ndarray) -> tuple[dict, memoryview]:
    n = int.from_bytes(blob[:8].tobytes(), "little")
    return json.loads(blob[8 : 8 + n].tobytes()), blob[8 + n :].data


def _write_step(parent: epath.Path, step: int, manifest: dict, data: Any, keep: int) -> None:
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
    for old in _steps(parent)[:-keep]:
        shutil.rmtree(parent / str(old), ignore_errors=True)


def _steps(parent: epath.Path) -> list[int]:
    if not parent.exists():
        return []
    return sorted(int(p.name) for p in parent.iterdir() if p.name.isdigit() and p.is_dir())


class _Copy(NamedTuple):
    manifest: dict
    arrays: memoryview


def _read_copy(where: epath.Path) -> _Copy:
    """Reads and verifies one step directory (raises ValueError on any damage)."""
    try:
        manifest = json.loads((where / "manifest.json").read_text())
        arrays = memoryview((where / "arrays.bin").read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from e
    try:
        _verify(manifest, arrays)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"its manifest is malformed ({type(e).__name__}: {e})") from e
    return _Copy(manifest, arrays)


def _try_read(where: epath.Path) -> _Copy | None:
    try:
        return _read_copy(where)
    except ValueError:
        return None


def _verify(manifest: dict, arrays: memoryview) -> None:
    if manifest.get("format") != FORMAT:
        raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
    for leaf in manifest["leaves"]:
        for shard in leaf["shards"]:
            lo, n = shard["offset"], shard["nbytes"]
            if lo + n > len(arrays) or zlib.crc32(arrays[lo : lo + n]) != shard["crc32"]:
                raise ValueError(f"the bytes of leaf {leaf['path']!r} fail their CRC-32")


# ---------------------------------------------------------------- placement
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
            if (d.id, json.dumps(_index(idx, shape))) not in held:
                return f"leaf {path!r} is placed differently (device {d.id})"
    return None


def _unpack(copy: _Copy, target: PyTree) -> PyTree:
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
                index = _index(idx, shape)
                part = _chunk(copy, by_index[json.dumps(index)], dtype, [b - a for a, b in index])
                buffers.append(jax.device_put(part, device))
            value = jax.make_array_from_single_device_arrays(shape, sharding, buffers)
        info = LeafInfo(_layout.path_str(kp), shape, dtype.name, leaf["key_impl"], None)
        out.append(_restore._finish_leaf(value, x, info))
    return jax.tree.unflatten(treedef, out)


def _chunk(copy: _Copy, shard: dict[str, Any], dtype: Any, shape: Sequence[int]) -> np.ndarray:
    """One stored shard of ``copy`` as an array (a view of its bytes)."""
    raw = copy.arrays[shard["offset"] : shard["offset"] + shard["nbytes"]]
    return np.frombuffer(raw, dtype).reshape(shape)


# ---------------------------------------------------------------- exchange
def _process_devices() -> list[jax.Device]:
    first: dict[int, jax.Device] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return [first[p] for p in range(jax.process_count())]


_shifters: dict[tuple, Any] = {}


def exchange(
    parts: Sequence[np.ndarray],
    pairs: Sequence[tuple[int, int]],
    what: str,
    lengths: np.ndarray | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> np.ndarray | None:
    """Sends the bytes of ``parts`` (1-D uint8 arrays, end to end) along ``pairs``
    (source, destination process), ``chunk_bytes`` at a time; all processes call it.

    ``what`` names the operation in errors; ``lengths``, every process's byte count,
    saves a collective when the caller has it. Returns the bytes this process
    received, or None if it is no destination.
    """
    n, me = jax.process_count(), jax.process_index()
    if lengths is None:
        lengths = _gather([sum(p.size for p in parts)], what)[:, 0]
    longest = int(lengths.max())
    # Up to whole MiB below a chunk: metadata that grows a little (the history) reuses
    # the compiled shift, without the up-to-2x padding of a power of two.
    chunk = min(chunk_bytes, max(1, -(-longest // _MIB)) * _MIB)
    devices = _process_devices()
    key = (tuple(d.id for d in devices), tuple(pairs), chunk)
    if key not in _shifters:
        mesh = Mesh(np.asarray(devices), ("process",))
        shift = jax.shard_map(
            lambda x: jax.lax.ppermute(x, "process", list(pairs)),
            mesh=mesh,
            in_specs=P("process"),
            out_specs=P("process"),
        )
        _shifters[key] = (jax.jit(shift), NamedSharding(mesh, P("process")))
    shift, sharding = _shifters[key]
    source = [s for s, d in pairs if d == me]
    received = np.empty(int(lengths[source[0]]), np.uint8) if source else None
    ends = list(itertools.accumulate(p.size for p in parts))
    staging = np.empty((1, chunk), np.uint8)
    for start in range(0, longest, chunk):  # as many on every process: `longest` is shared
        _fill(staging[0], parts, ends, start)
        x = jax.make_array_from_single_device_arrays(
            (n, chunk), sharding, [jax.device_put(staging, devices[me])]
        )
        # Dispatched in the bounded thread too: XLA:CPU may run a collective inline.
        y = _bounded(functools.partial(_run, shift, x), what)
        if received is not None and start < received.size:
            m = min(chunk, received.size - start)
            received[start : start + m] = np.asarray(y.addressable_data(0))[0, :m]
        del x, y  # before the next chunk's buffers, not after
    return received


def _run(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    return fn(x).block_until_ready()


def _fill(dest: np.ndarray, parts: Sequence[np.ndarray], ends: list[int], start: int) -> None:
    """Copies bytes ``start:start + dest.size`` of ``parts`` laid end to end (``ends``:
    where each part ends) into ``dest``, and zeros past their end."""
    filled, i = 0, bisect.bisect_right(ends, start)  # the part that holds byte `start`
    while filled < dest.size and i < len(parts):
        lo = start + filled - (ends[i] - parts[i].size)
        m = min(parts[i].size - lo, dest.size - filled)
        dest[filled : filled + m] = parts[i][lo : lo + m]
        filled += m
        i += 1
    dest[filled:] = 0


def peer_shift(what: str) -> int:
    """The ring offset to a process on another host (1 when all share one host)."""
    n = jax.process_count()
    hosts = _gather([zlib.crc32(socket.gethostname().encode())], what)[:, 0]
    for k in range(1, n):
        if all(hosts[(p + k) % n] != hosts[p] for p in range(n)):
            return k
    return 1


# ---------------------------------------------------------------- the tier
class LocalTier:
    """One process's part of the local tier (built by ``CheckpointManager``)."""

    def __init__(self, directory: epath.Path, save_interval_steps: int, max_to_keep: int) -> None:
        self.root = directory
        self.interval = save_interval_steps
        self.keep = max_to_keep
        self.own = directory / f"process-{jax.process_index()}"
        self._thread: threading.Thread | None = None
        self._failed: tuple[int, BaseException] | None = None  # a write's step and error
        self._shift: int | None = None
        for leftover in self.own.glob(".*.tmp-*") if self.own.exists() else []:
            shutil.rmtree(leftover, ignore_errors=True)  # a process killed mid-write

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: PyTree, data_json: Any, meta_json: Any) -> None:
        """Copies this process's shards to the host, sends them to the peer, and writes
        both copies in the background. All processes call it together.

        Raises:
          OSError: on every process, if the previous background write failed on any
            (this step is not saved); names each such process and why.
        """
        self._join()
        failed, self._failed = self._failed, None
        mine = "" if failed is None else _failure(failed)
        manifest, chunks = _pack(step, state, data_json, meta_json)
        n = jax.process_count()
        parts = [_head(manifest), *chunks] if n > 1 else []
        what = f"the local checkpoint tier's save of step {step}"
        # One collective tells every process both the sizes to exchange and whether a
        # write failed anywhere: all raise together, none waits for one that raised.
        status = _gather([sum(p.size for p in parts), *_encode(mine)], what)
        failures = [text for text in (_decode(row[1:]) for row in status) if text]
        if failures:
            raise OSError(
                f"The local checkpoint tier's {'; '.join(failures)}, so every process raises "
                f"this at the save of step {step}. The persistent checkpoints are unaffected; "
                "make the local directory named there writable (free space) or choose another "
                "local_directory."
            ) from (None if failed is None else failed[1])
        peer: tuple[int, np.ndarray] | None = None
        if n > 1:
            if self._shift is None:
                self._shift = peer_shift(what)
            k = self._shift
            pairs = [(p, (p + k) % n) for p in range(n)]
            got = exchange(parts, pairs, what, lengths=status[:, 0])
            assert got is not None  # every process is a destination of the ring
            peer = ((jax.process_index() - k) % n, got)

        def write() -> None:
            try:
                _write_step(self.own, step, manifest, chunks, self.keep)
                if peer is not None:
                    source, blob = peer
                    for other in self.own.glob("peer-of-*"):
                        if other.name != f"peer-of-{source}":  # the ring changed
                            shutil.rmtree(other, ignore_errors=True)
                    head, arrays = _from_blob(blob)
                    _write_step(self.own / f"peer-of-{source}", step, head, [arrays], self.keep)
            except BaseException as e:  # noqa: BLE001 - raised by the next save or wait
                self._failed = (step, e)

        self._thread = threading.Thread(target=write, name="distrain-local-save", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        """Waits for the background write. Its error, if any, stays for the next save:
        raised here, on this process alone, it would leave the others waiting."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def wait_until_finished(self) -> None:
        """Waits for the background write; raises its error (this process's only)."""
        self._join()
        failed, self._failed = self._failed, None
        if failed is not None:
            raise OSError(
                f"The local checkpoint tier's {_failure(failed)}. The persistent checkpoints "
                "are unaffected; make the local directory named there writable (free space) or "
                "choose another local_directory."
            ) from failed[1]

    # --------------------------------------------------------------- restore
    def _scan(self, parent: epath.Path, what: str) -> list[int]:
        """The steps under ``parent`` that verify, newest first (warns for the others)."""
        good = []
        for step in reversed(_steps(parent)):
            try:
                _read_copy(parent / str(step))
            except ValueError as e:
                warnings.warn(
                    f"Local checkpoint tier: {what} of step {step} in {parent / str(step)} is "
                    f"damaged ({e}); it is ignored.",
                    stacklevel=4,
                )
                continue
            good.append(step)
        return good[:_SLOTS]

    def restore(self, target: PyTree, newer_than: int | None) -> LocalRestore | None:
        """The newest step every process can restore from the tier, if newer than
        ``newer_than`` and placed as ``target`` is; None otherwise. Collective.

        Raises:
          ConnectionError: another process died during the restore.
          TimeoutError: another process did not answer within ``WAIT_SECONDS``.
        """
        self._join()
        what = "the local checkpoint tier's restore"
        n, me = jax.process_count(), jax.process_index()
        own = self._scan(self.own, "this process's copy")
        reason = None
        if own:
            manifest = json.loads((self.own / str(own[0]) / "manifest.json").read_text())
            reason = layout_difference(manifest, target)
        peers = sorted(self.own.glob("peer-of-*")) if self.own.exists() else []
        source = int(peers[0].name.removeprefix("peer-of-")) if peers else -1
        held = self._scan(peers[0], f"the copy of process {source}") if peers else []
        views = _gather([0 if reason is None else 1, source, *_pad(own), *_pad(held)], what)
        if views[:, 0].any():
            who = int(np.argmax(views[:, 0]))
            if reason is None:
                reason = f"on process {who}"
            warnings.warn(
                f"Local checkpoint tier ignored: the state's layout changed since it was saved "
                f"({reason}); restoring from the persistent checkpoints.",
                stacklevel=3,
            )
            return None
        owns = [set(int(s) for s in v[2 : 2 + _SLOTS] if s >= 0) for v in views]
        holds = {
            int(v[1]): (r, set(int(s) for s in v[2 + _SLOTS :] if s >= 0))
            for r, v in enumerate(views)
            if v[1] >= 0
        }
        step = None
        for s in sorted(set().union(*owns, *(h for _, h in holds.values())), reverse=True):
            if newer_than is not None and s < newer_than:
                break
            if all(s in owns[q] or (q in holds and s in holds[q][1]) for q in range(n)):
                step = s
                break
        if step is None:
            return None
        pairs = [(holds[q][0], q) for q in range(n) if step not in owns[q]]
        # From here on no process may raise alone (the others would wait in a
        # collective): a copy that vanished or broke since the scan is a failure all
        # processes agree on, and the persistent tier is used.
        copy, reason = None, f"its copy of step {step} could not be read back"
        if step in owns[me]:
            copy = _try_read(self.own / str(step))
        if pairs:
            parts: list[np.ndarray] = []
            if any(src == me for src, _ in pairs):
                c = _try_read(peers[0] / str(step))
                if c is not None:
                    parts = [_head(c.manifest), np.frombuffer(c.arrays, np.uint8)]
            got = exchange(parts, pairs, what)
            if got is not None and got.size:
                head, arrays = _from_blob(got)
                try:
                    _verify(head, arrays)
                    copy = _Copy(head, arrays)
                except ValueError:
                    pass
        if copy is not None:
            # A copy from the peer was not checked against this process's target yet.
            reason = layout_difference(copy.manifest, target)
        if _gather([0 if reason is None else 1], what)[:, 0].any():
            warnings.warn(
                f"Local checkpoint tier ignored: step {step} cannot be restored as saved "
                f"({reason or 'on another process'}); restoring from the persistent checkpoints.",
                stacklevel=3,
            )
            return None
        assert copy is not None  # agreed above: every process has its copy
        state = _unpack(copy, target)
        m = copy.manifest
        return LocalRestore(
            step,
            state,
            _layout.from_json(m["data_state"]),
            _layout.from_json(m["metadata"]),
            tuple(q for _, q in pairs),
        )

    def drop_newer_than(self, step: int) -> None:
        """Deletes this process's copies of steps after ``step``: a run that resumed
        from ``step`` must never later restore a state of the timeline it abandoned."""
        self._join()
        parents = [self.own, *(self.own.glob("peer-of-*") if self.own.exists() else [])]
        for parent in parents:
            for s in _steps(parent):
                if s > step:
                    shutil.rmtree(parent / str(s), ignore_errors=True)

    def delete(self) -> None:
        """Removes this process's part of the tier (own and peer copies), and the tier's
        directory once no process's part is left in it (an empty ``local/`` stayed)."""
        self._join()
        self._failed = None  # a failed write of what is deleted now no longer matters
        shutil.rmtree(self.own, ignore_errors=True)
        try:  # os.rmdir: epath's rmdir raises ValueError, not OSError, when not empty
            os.rmdir(self.own.parent)
        except OSError:  # another process's part is still there (it removes it last)
            pass


def _pad(steps: list[int]) -> list[int]:
    return (steps + [-1] * _SLOTS)[:_SLOTS]


def _gather(row: list[int], what: str) -> np.ndarray:
    """Every process's ``row`` of int64s (all call it together), one row per process."""
    mine = np.asarray(row, np.int64)
    if jax.process_count() == 1:
        return mine[None]
    from jax.experimental import multihost_utils

    # As int32 halves: without jax_enable_x64 an int64 would travel truncated to 32 bits
    # (a state over 2 GiB, a message's bytes).
    halves = mine.view(np.int32)
    rows = _bounded(lambda: np.asarray(multihost_utils.process_allgather(halves)), what)
    return np.ascontiguousarray(rows, np.int32).view(np.int64).reshape(jax.process_count(), -1)


def _bounded(collective: Callable[[], _T], what: str) -> _T:
    """``collective()`` (one of the tier's collectives), waited for ``WAIT_SECONDS`` at
    most; a peer lost or silent during it raises here, saying so and what to do.

    A collective cannot be cancelled: on a timeout it is left waiting in its daemon
    thread, and the processes are out of step from then on.
    """
    outcome: list[Any] = []  # [result] or [None, error]

    def run() -> None:
        try:
            outcome.append(collective())
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            outcome.extend([None, e])

    thread = threading.Thread(target=run, name="distrain-local-collective", daemon=True)
    thread.start()
    thread.join(WAIT_SECONDS)
    todo = (
        "restart the whole job (every process, as `distrain launch --max-restarts` does): "
        "it resumes from the newest checkpoint every process can read, and the local "
        "tier's copies on disk are intact."
    )
    me = jax.process_index()
    if not outcome:
        raise TimeoutError(
            f"Process {me} waited {WAIT_SECONDS:.0f} s for the other processes during {what}, "
            f"in vain: one of them froze, lost its host or is stuck (see their logs); {todo}"
        )
    if len(outcome) == 2:
        error = outcome[1]
        if isinstance(error, jax.errors.JaxRuntimeError):  # gloo's or NCCL's, from a peer
            first = str(error).strip().splitlines()[0][:300]
            raise ConnectionError(
                f"Process {me}'s collective with the other processes failed during {what} "
                f"({type(error).__name__}: {first}): most often a process of the job died or "
                f"was killed (else the error above says why); {todo}"
            ) from error
        raise error
    return outcome[0]


def _failure(failed: tuple[int, BaseException]) -> str:
    step, error = failed
    return (
        f"write of step {step} failed on process {jax.process_index()} "
        f"({type(error).__name__}: {error})"
    )


def _encode(text: str) -> list[int]:
    """``text`` (its first ``_MESSAGE_BYTES`` bytes) as int64s, for ``_gather``."""
    raw = text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    return np.frombuffer(raw, np.int64).tolist()


def _decode(row: np.ndarray) -> str:
    return np.asarray(row, np.int64).tobytes().rstrip(b"\0").decode(errors="replace")


def check_arguments(
    persistent: str | os.PathLike[str],
    local: str | os.PathLike[str] | None,
    interval: int | None,
    interval_name: str = "local_save_interval_steps",
) -> tuple[epath.Path, int] | None:
    """The local tier's directory (absolute) and interval, None without a tier.

    Raises:
      ValueError: an interval without a directory or the reverse, an interval below 1,
        or a local directory inside (or around) the persistent one.
    """
    if local is None:
        if interval is not None:
            raise ValueError(
                f"{interval_name} was given without local_directory: pass local_directory= "
                "(node-local storage such as /dev/shm/<run>) or drop it."
            )
        return None
    if interval is None:
        raise ValueError(
            f"local_directory={os.fspath(local)!r} needs {interval_name}= (the steps "
            "between local saves, e.g. a tenth of the persistent interval)."
        )
    interval = positive_int(interval_name, interval)
    path = epath.Path(os.path.abspath(os.fspath(local)))
    a, b = os.path.realpath(path), os.path.realpath(os.path.abspath(os.fspath(persistent)))
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise ValueError(
            f"Expected a local_directory apart from the persistent checkpoint directory "
            f"{b}; received {path}, which "
            + ("is inside it" if a.startswith(b + os.sep) else "is the same or contains it")
            + ". Use node-local storage such as /dev/shm/<run> or a local disk."
        )
    return path, interval
