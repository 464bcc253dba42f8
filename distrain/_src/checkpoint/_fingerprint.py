"""Content fingerprints of arrays, to detect checkpoint files that were garbled.

Orbax does not checksum array data: a checkpoint whose data files had bytes flipped
restores without error but with wrong values (seen with orbax-checkpoint 0.12.8).
``CheckpointManager`` therefore stores a fingerprint of every leaf next to the state
and compares it after restoring.

A fingerprint is two 32-bit sums over the leaf's raw bits, each word weighted by a
function of its position. Integer sums modulo 2**32 do not depend on the order of
the additions, so the value is the same whether the array is computed on one device,
sharded over eight, spread over several processes, or held in NumPy on the host;
``fingerprint_numpy`` and ``fingerprint_jax`` return identical values for the same
bits. Computing it is one pass over the data, on the devices that hold it.

Example:
  >>> fingerprint_numpy(np.arange(3, dtype=np.float32)) == fingerprint_jax([jnp.arange(3.0)])[0]
  True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

# Odd multipliers (golden-ratio and murmur3 constants) so every position gets a
# distinct weight modulo 2**32.
_M1, _M2, _M3 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35


def supported(dtype: np.dtype) -> bool:
    """Whether leaves of ``dtype`` can be fingerprinted (plain numeric or bool)."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" and dtype.itemsize in (1, 2, 4, 8, 16)


def _finish(h1: Any, h2: Any) -> str:
    """Hex of two 32-bit words (Python or NumPy integers)."""
    return f"{int(h1) & 0xFFFFFFFF:08x}{int(h2) & 0xFFFFFFFF:08x}"


def _words_numpy(x: np.ndarray) -> np.ndarray:
    """The array's bits as uint32 words, in C order (wider dtypes give several words)."""
    x = np.ascontiguousarray(x)
    if x.dtype.kind == "b":
        x = x.view(np.uint8)
    size = x.dtype.itemsize
    if size == 1:
        return x.view(np.uint8).astype(np.uint32)
    if size == 2:
        return x.view(np.uint16).astype(np.uint32)
    return x.view(np.uint32).reshape(*x.shape, size // 4)  # complex: (real, imag) words


def fingerprint_numpy(x: np.ndarray) -> str:
    """Fingerprint of a host array (hex string of 64 bits)."""
    w = _words_numpy(np.asarray(x)).reshape(-1)
    i = np.arange(w.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        h1 = np.sum(w * (i * np.uint32(_M1) + np.uint32(1)), dtype=np.uint32)
        h2 = np.sum((w ^ (i * np.uint32(_M2))) * np.uint32(_M3), dtype=np.uint32)
    return _finish(h1, h2)


def _words_jax(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    size = x.dtype.itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if size == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    # 8-byte dtypes gain a trailing axis of two words, as in the NumPy view.
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _one_jax(x: jax.Array) -> jax.Array:
    w = _words_jax(x)
    # Row-major position of every word, built from iotas so the array never has to
    # be reshaped (a reshape of a sharded array could move data between devices).
    pos = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(w.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, w.shape, dim) * jnp.uint32(
            stride & 0xFFFFFFFF
        )
        stride *= w.shape[dim]
    h1 = jnp.sum(w * (pos * jnp.uint32(_M1) + jnp.uint32(1)), dtype=jnp.uint32)
    h2 = jnp.sum((w ^ (pos * jnp.uint32(_M2))) * jnp.uint32(_M3), dtype=jnp.uint32)
    return jnp.stack([h1, h2])


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_one_jax(x) for x in leaves]


def fingerprint_jax(leaves: Sequence[jax.Array]) -> list[str]:
    """Fingerprints of device arrays (any sharding), in one compiled pass.

    All processes must call this together when the arrays span several processes.
    """
    # One compiled call per device set: a jit cannot mix arrays committed to
    # different devices (say, a state on a mesh and a key left on cpu:0).
    # A fully replicated array is fingerprinted from one local copy: hashing all N
    # copies would cost N times the work (and, on CPU, the cores the training uses).
    local = [x.addressable_data(0) if x.sharding.is_fully_replicated else x for x in leaves]
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(local):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    result = [""] * len(leaves)
    for idx in groups.values():
        out = jax.device_get(_fingerprints([local[i] for i in idx]))
        for i, h in zip(idx, out, strict=True):
            result[i] = _finish(h[0], h[1])
    return result


def fingerprint_any(leaves: Sequence[object]) -> list[str | None]:
    """Fingerprints of a mix of device arrays and host values; None where unsupported."""
    result: list[str | None] = [None] * len(leaves)
    device_idx = []
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            if supported(x.dtype):
                device_idx.append(i)
        else:
            a = np.asarray(x)
            if supported(a.dtype):
                result[i] = fingerprint_numpy(a)
    arrays = [cast(jax.Array, leaves[i]) for i in device_idx]
    for i, fp in zip(device_idx, fingerprint_jax(arrays), strict=True):
        result[i] = fp
    return result
