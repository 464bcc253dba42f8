"""Quantized outer gradients: what each island sends at a sync (Streaming DiLoCo).

Each island encodes its own pseudo-gradient (global minus its parameters) one tensor at
a time; the islands all-gather the encodings, and every island decodes them and
averages in float32. The average is never taken in the quantized type: a sum of int8
codes overflows, and the codes of different islands have different scales.

Codecs (``outer_dtype``):

* ``"float32"``: no encoding (the islands all-reduce float32);
* ``"bfloat16"``: a cast, relative error at most ``2**-8`` (round to nearest);
* ``"int8"``: absmax per tensor, ``scale = max|x| / 127``, codes in ``[-127, 127]``;
* ``"int4"``: absmax per tensor, ``scale = max|x| / 7``, codes in ``[-7, 7]`` packed two
  per byte (element ``2i`` in the low nibble, ``2i + 1`` in the high one, two's
  complement), so a tensor of ``n`` elements travels as ``ceil(n / 2)`` bytes and one
  float32 scale.

Fault-isolated islands use the same codecs over their exchange (``outer_dtype`` of
``islands.train`` / ``FaultIsolation``): an island packs each segment it sends a shard
holder (:func:`pack`: a leaf, or the part of it one holder keeps, so the absmax scale
is per segment), and the holder unpacks it (:func:`unpack`) before it averages in
float32.

The absmax codecs round to nearest: the error of every element is at most ``scale / 2``
(plus float32 rounding of the division), and values that are integer multiples of the
scale come back exactly. A tensor of zeros has scale 0 and decodes to zeros; a
non-finite element makes the whole tensor's scale non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

OuterDType = Literal["float32", "bfloat16", "int8", "int4"]
OUTER_DTYPES: tuple[OuterDType, ...] = ("float32", "bfloat16", "int8", "int4")

# The largest code of each absmax codec (symmetric: -QMAX..QMAX, zero exact).
_QMAX = {"int8": 127, "int4": 7}


class Encoded(NamedTuple):
    """One island's encoding of one tensor (a pytree: it can be all-gathered).

    Attributes:
      data: ``bfloat16`` values, ``int8`` codes of the tensor's shape, or ``uint8``
        packed nibbles of shape ``(ceil(size / 2),)``; float32 values for ``"float32"``.
      scale: the float32 scalar of the absmax codecs, ``None`` otherwise.
    """

    data: jax.Array
    scale: jax.Array | None


def outer_dtype_name(outer_dtype: Any) -> OuterDType:
    """The codec's name for ``outer_dtype``: a name or a dtype (``jnp.bfloat16``).

    ``None`` means ``"float32"``.

    Raises:
      ValueError: not one of float32, bfloat16, int8, int4.

    Example:
      >>> outer_dtype_name(jnp.bfloat16)
      'bfloat16'
    """
    if outer_dtype is None:
        return "float32"
    try:
        name = np.dtype(outer_dtype).name
    except TypeError:
        name = str(outer_dtype)
    if name not in OUTER_DTYPES:
        raise ValueError(
            f"outer_dtype must be one of {list(OUTER_DTYPES)} (or None for float32). "
            f"Received: outer_dtype={outer_dtype!r}."
        )
    return name


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Packs int codes in ``[-8, 7]`` two per byte: ``uint8`` of shape ``(ceil(n / 2),)``.

    The codes are flattened; an odd count is padded with a zero code.

    Example:
      >>> pack_nibbles(jnp.array([-7, 7, 0]))   # 0b0111_1001, 0b0000_0000
      Array([121,   0], dtype=uint8)
    """
    flat = jnp.ravel(codes).astype(jnp.int8)
    if flat.size % 2:
        flat = jnp.concatenate([flat, jnp.zeros((1,), jnp.int8)])
    nibbles = jax.lax.bitcast_convert_type(flat, jnp.uint8) & 0x0F
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack_nibbles(packed: jax.Array, size: int) -> jax.Array:
    """The ``size`` int8 codes that :func:`pack_nibbles` packed (sign-extended).

    Example:
      >>> unpack_nibbles(jnp.array([121, 0], jnp.uint8), 3)
      Array([-7,  7,  0], dtype=int8)
    """
    packed = packed.astype(jnp.uint8)
    nibbles = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(-1)[:size]
    # Shift the nibble into the top of an int8 and back: an arithmetic shift
    # sign-extends bit 3.
    return jax.lax.bitcast_convert_type(nibbles << 4, jnp.int8) >> 4


def encode(x: jax.typing.ArrayLike, outer_dtype: OuterDType) -> Encoded:
    """Encodes one tensor with the codec ``outer_dtype`` (per-tensor absmax for ints).

    Args:
      x: the tensor (any float dtype; encoded from its float32 value).
      outer_dtype: ``"float32"``, ``"bfloat16"``, ``"int8"`` or ``"int4"``.

    Returns:
      The :class:`Encoded` payload; :func:`decode` with the tensor's shape undoes it.

    Example:
      >>> e = encode(jnp.array([-7.0, 3.5, 0.0]), "int4")   # scale 1
      >>> e.data, e.scale                     # codes -7, 4, 0 (3.5 rounds to even)
      (Array([73,  0], dtype=uint8), Array(1., dtype=float32))
      >>> decode(e, "int4", (3,))
      Array([-7.,  4.,  0.], dtype=float32)
    """
    x = jnp.asarray(x, jnp.float32)
    if outer_dtype == "float32":
        return Encoded(x, None)
    if outer_dtype == "bfloat16":
        # reduce_precision first: XLA drops a float32 -> bfloat16 -> float32 round trip
        # inside one program (excess precision allowed), and did in pseudo_gradient
        # without a strategy, which then returned float32's result.
        rounded = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
        return Encoded(rounded.astype(jnp.bfloat16), None)
    qmax = _QMAX[outer_dtype]
    scale = jnp.max(jnp.abs(x)) / qmax if x.size else jnp.zeros((), jnp.float32)
    codes = jnp.clip(jnp.round(x / jnp.where(scale > 0, scale, 1.0)), -qmax, qmax)
    codes = codes.astype(jnp.int8)
    data = pack_nibbles(codes) if outer_dtype == "int4" else codes
    return Encoded(data, scale)


def decode(encoded: Encoded, outer_dtype: OuterDType, shape: Sequence[int]) -> jax.Array:
    """The float32 tensor of ``shape`` that ``encoded`` stands for.

    Example:
      >>> decode(encode(jnp.array([127.0, -1.0]), "int8"), "int8", (2,))
      Array([127.,  -1.], dtype=float32)
    """
    shape = tuple(shape)
    if outer_dtype in ("float32", "bfloat16"):
        return encoded.data.astype(jnp.float32).reshape(shape)
    if encoded.scale is None:
        raise ValueError(
            f"An {outer_dtype} encoding carries a scale; received one without. Decode "
            "what encode(x, outer_dtype) returned with the same outer_dtype."
        )
    codes = encoded.data
    if outer_dtype == "int4":
        codes = unpack_nibbles(codes, math.prod(shape))
    return (codes.astype(jnp.float32) * encoded.scale).reshape(shape)


def payload_bytes(shape: Sequence[int], outer_dtype: OuterDType) -> int:
    """Bytes one island sends for a tensor of ``shape`` (codes plus the scale).

    Example:
      >>> payload_bytes((1000,), "int4")     # 500 bytes of nibbles + a float32 scale
      504
    """
    size = math.prod(shape)
    if outer_dtype == "float32":
        return 4 * size
    if outer_dtype == "bfloat16":
        return 2 * size
    return (size if outer_dtype == "int8" else (size + 1) // 2) + 4


class Packed(NamedTuple):
    """One segment as an island sends it to a shard holder: host arrays of
    :class:`Encoded` and the codec's name."""

    codec: OuterDType
    data: np.ndarray
    scale: np.ndarray | None

    @property
    def nbytes(self) -> int:
        """The bytes it carries (codes plus the scale)."""
        return int(self.data.nbytes) + (0 if self.scale is None else 4)


def pack(x: np.ndarray, outer_dtype: OuterDType) -> Packed:
    """``x`` (a 1-D float segment) encoded on the host.

    Example:
      >>> pack(np.array([-7.0, 3.5, 0.0], np.float32), "int4").nbytes
      6
    """
    e = encode(x, outer_dtype)
    return Packed(outer_dtype, np.asarray(e.data), None if e.scale is None else np.asarray(e.scale))


def unpack(p: Packed, size: int) -> np.ndarray:
    """The float32 segment of ``size`` elements that ``p`` stands for.

    Raises:
      ValueError: ``p`` does not carry ``size`` elements of its codec.
    """
    expected = payload_bytes((size,), p.codec)
    if p.nbytes != expected:
        raise ValueError(
            f"a {p.codec} segment of {size} elements is {expected} bytes; received "
            f"{p.nbytes}. Expected what codecs.pack made of the segment."
        )
    encoded = Encoded(jnp.asarray(p.data), None if p.scale is None else jnp.asarray(p.scale))
    return np.asarray(decode(encoded, p.codec, (size,)))
