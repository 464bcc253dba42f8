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
(``local_directory=``); it has no public entry point of its own. A copy's format is
``_local_copy.py``'s, the collectives between processes ``_process_exchange.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

# `_process_exchange.gather` is looked up on the module at each call: a test wraps it to
# stop a process right after one of the tier's collectives (tests/scripts/ckpt_local.py).
from distrain._src.checkpoint import _layout, _process_exchange
from distrain._src.checkpoint._local_copy import (
    Copy,
    from_blob,
    head_bytes,
    layout_difference,
    pack,
    read_copy,
    saved_steps,
    try_read,
    unpack,
    verify,
    write_step,
)
from distrain._src.checkpoint._process_exchange import decode, encode, exchange, peer_shift
from distrain._src.pytree import PyTree
from distrain._src.validate import positive_int

_SLOTS = 8  # steps each process reports at restore (keep is at most this)


class LocalRestore(NamedTuple):
    """A state read back from the local tier."""

    step: int
    state: PyTree
    data_state: Any
    metadata: Any
    from_peer: tuple[int, ...]  # processes whose copy came from their peer


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
        manifest, chunks = pack(step, state, data_json, meta_json)
        n = jax.process_count()
        parts = [head_bytes(manifest), *chunks] if n > 1 else []
        what = f"the local checkpoint tier's save of step {step}"
        # One collective tells every process both the sizes to exchange and whether a
        # write failed anywhere: all raise together, none waits for one that raised.
        status = _process_exchange.gather([sum(p.size for p in parts), *encode(mine)], what)
        failures = [text for text in (decode(row[1:]) for row in status) if text]
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
                write_step(self.own, step, manifest, chunks, self.keep)
                if peer is not None:
                    source, blob = peer
                    for other in self.own.glob("peer-of-*"):
                        if other.name != f"peer-of-{source}":  # the ring changed
                            shutil.rmtree(other, ignore_errors=True)
                    head, arrays = from_blob(blob)
                    write_step(self.own / f"peer-of-{source}", step, head, [arrays], self.keep)
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
        for step in reversed(saved_steps(parent)):
            try:
                read_copy(parent / str(step))
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
          TimeoutError: another process did not answer within ``WAIT_SECONDS``
            (``_process_exchange``'s).
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
        views = _process_exchange.gather(
            [0 if reason is None else 1, source, *_pad(own), *_pad(held)], what
        )
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
            copy = try_read(self.own / str(step))
        if pairs:
            parts: list[np.ndarray] = []
            if any(src == me for src, _ in pairs):
                c = try_read(peers[0] / str(step))
                if c is not None:
                    parts = [head_bytes(c.manifest), np.frombuffer(c.arrays, np.uint8)]
            got = exchange(parts, pairs, what)
            if got is not None and got.size:
                head, arrays = from_blob(got)
                try:
                    verify(head, arrays)
                    copy = Copy(head, arrays)
                except ValueError:
                    pass
        if copy is not None:
            # A copy from the peer was not checked against this process's target yet.
            reason = layout_difference(copy.manifest, target)
        if _process_exchange.gather([0 if reason is None else 1], what)[:, 0].any():
            warnings.warn(
                f"Local checkpoint tier ignored: step {step} cannot be restored as saved "
                f"({reason or 'on another process'}); restoring from the persistent checkpoints.",
                stacklevel=3,
            )
            return None
        assert copy is not None  # agreed above: every process has its copy
        state = unpack(copy, target)
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
            for s in saved_steps(parent):
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


def _failure(failed: tuple[int, BaseException]) -> str:
    step, error = failed
    return (
        f"write of step {step} failed on process {jax.process_index()} "
        f"({type(error).__name__}: {error})"
    )


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
