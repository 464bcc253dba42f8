"""Collectives between the processes of a job, for the local checkpoint tier.

:func:`exchange` sends bytes along pairs of processes by ``ppermute`` over a mesh of one
device per process (the accelerator network on GPUs and TPUs, gloo on CPU; nothing but
JAX), in chunks of ``CHUNK_BYTES``: a device holds one chunk and the one it receives,
whatever the state's size. :func:`gather` all-gathers a small row of int64s (sizes, the
steps each process holds, a failed write's message through :func:`encode`). Each waits
``WAIT_SECONDS`` at most (:func:`bounded`): a peer that died raises ``ConnectionError``
at once, one that stopped answering ``TimeoutError``, instead of waiting forever.

Example:
  >>> sizes = gather([len(blob)], "the save of step 10")[:, 0]
  >>> got = exchange([blob], [(0, 1), (1, 0)], "the save of step 10", lengths=sizes)
"""

from __future__ import annotations

import bisect
import functools
import itertools
import socket
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "CHUNK_BYTES",
    "WAIT_SECONDS",
    "bounded",
    "decode",
    "encode",
    "exchange",
    "gather",
    "peer_shift",
]

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
        lengths = gather([sum(p.size for p in parts)], what)[:, 0]
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
        y = bounded(functools.partial(_run, shift, x), what)
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
    hosts = gather([zlib.crc32(socket.gethostname().encode())], what)[:, 0]
    for k in range(1, n):
        if all(hosts[(p + k) % n] != hosts[p] for p in range(n)):
            return k
    return 1


def gather(row: list[int], what: str) -> np.ndarray:
    """Every process's ``row`` of int64s (all call it together), one row per process."""
    mine = np.asarray(row, np.int64)
    if jax.process_count() == 1:
        return mine[None]
    from jax.experimental import multihost_utils

    # As int32 halves: without jax_enable_x64 an int64 would travel truncated to 32 bits
    # (a state over 2 GiB, a message's bytes).
    halves = mine.view(np.int32)
    rows = bounded(lambda: np.asarray(multihost_utils.process_allgather(halves)), what)
    return np.ascontiguousarray(rows, np.int32).view(np.int64).reshape(jax.process_count(), -1)


def bounded(collective: Callable[[], _T], what: str) -> _T:
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


def encode(text: str) -> list[int]:
    """``text`` (its first ``_MESSAGE_BYTES`` bytes) as int64s, for :func:`gather`."""
    raw = text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    return np.frombuffer(raw, np.int64).tolist()


def decode(row: np.ndarray) -> str:
    """The text :func:`encode` made."""
    return np.asarray(row, np.int64).tobytes().rstrip(b"\0").decode(errors="replace")
