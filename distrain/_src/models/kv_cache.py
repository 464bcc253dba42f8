"""A preallocated key/value cache, and the attention over it that generation runs.

:func:`distrain.models.generate` runs a model's own ``__call__`` over one new token at a
time; the model's attention layers ask :func:`current` whether a call is *decoding*
(inside :func:`decoding`) and, if so, hand their rotated ``q, k, v`` to
:meth:`Decoding.attend` instead of ``dt.nn.dot_product_attention``. That writes the new
keys and values into the layer's slots of the cache and attends over the slots. The
training path is untouched: outside :func:`decoding`, :func:`current` is ``None``.

The cache holds, per slot, a segment id (``-1``: not written yet, ``0``: left padding,
``1``: a token) and a position, and a query sees a key when both have the same segment
and ``position_key <= position_query``: ``dt.nn.dot_product_attention``'s own rule
(``attention.py``), so padded rows and unwritten slots are masked as packed documents
are, and every row computes what it computes alone.

The decoding scope is a context variable, as ``nnx.use_eager_sharding`` is: the layers of
one model call consume the cache in call order (layer ``i`` takes slot set ``i``), so the
call must not run its blocks under a transformation that traces them separately
(``jax.checkpoint``, a pipeline's scan): ``generate`` builds the module without remat and
refuses pipelined models.

Example:
  >>> cache = KVCache.zeros(layers=2, batch=1, length=16, kv_heads=4, head_dim=8,
  ...                       dtype=jnp.float32)
  >>> seg, pos = jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None]
  >>> with decoding(cache, 0, seg, pos) as step:
  ...     logits = module(tokens, segment_ids=seg, positions=pos)
  >>> cache = step.result()               # slots 0..2 written, in every layer
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, final

import jax
import jax.numpy as jnp

__all__ = ["Decoding", "KVCache", "current", "decoding"]

#: The segment id of a slot no token was written to: no query's segment.
EMPTY = -1
# jax.nn.dot_product_attention's masked logit (-0.7 x float32's largest): finite.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every attention layer, ``length`` slots per row.

    Attributes:
      keys: one ``[B, K, D, S]`` array per layer (``K`` key/value heads of size ``D``):
        transposed, the layout of the right operand of ``q @ k^T`` that XLA's batched
        matmul reads in place (with ``[B, S, K, D]`` the compiled loop copied each layer's
        key cache for every token: a GPT-2-small step at batch 32 on CPU took 1.33x as
        long).
      values: one ``[B, K, S, D]`` array per layer (``probs @ v``'s right operand).
      segment_ids: ``[B, S]`` int32: ``-1`` an empty slot, ``0`` padding, ``1`` a token.
      positions: ``[B, S]`` int32: the position of the token in each slot.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    segment_ids: jax.Array
    positions: jax.Array

    @classmethod
    def zeros(
        cls, *, layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype: Any
    ) -> KVCache:
        """An empty cache (every slot ``EMPTY``)."""
        keys, values = (batch, kv_heads, head_dim, length), (batch, kv_heads, length, head_dim)
        return cls(
            keys=tuple(jnp.zeros(keys, dtype) for _ in range(layers)),
            values=tuple(jnp.zeros(values, dtype) for _ in range(layers)),
            segment_ids=jnp.full((batch, length), EMPTY, jnp.int32),
            positions=jnp.zeros((batch, length), jnp.int32),
        )


@final
class Decoding:
    """One call of a model that writes ``T`` tokens per row at slots ``index ..
    index + T - 1`` of ``cache`` and attends over all of them (made by :func:`decoding`).

    Args:
      cache: the cache before the call.
      index: the first slot written (the same for every row: rows are left-padded).
      segment_ids: ``[B, T]`` of the new tokens (``1``; ``0`` for padding).
      positions: ``[B, T]`` of the new tokens.
    """

    def __init__(
        self, cache: KVCache, index: jax.Array | int, segment_ids: jax.Array, positions: jax.Array
    ) -> None:
        self._cache, self._index = cache, index
        self._seg_q = segment_ids.astype(jnp.int32)
        self._pos_q = positions.astype(jnp.int32)
        self._seg_k = _write(cache.segment_ids, self._seg_q, index)
        self._pos_k = _write(cache.positions, self._pos_q, index)
        # [B, 1, 1, T, S]: dt.nn.dot_product_attention's rule over the cache's slots.
        self._mask = (
            (self._seg_q[:, :, None] == self._seg_k[:, None, :])
            & (self._pos_q[:, :, None] >= self._pos_k[:, None, :])
        )[:, None, None]
        self._keys: list[jax.Array] = []
        self._values: list[jax.Array] = []

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Writes ``k, v`` ``[B, T, K, D]`` into the next layer's slots and returns the
        attention of ``q`` ``[B, T, N, D]`` over the cache, ``[B, T, N, D]``.

        Raises:
          ValueError: more attention calls than the cache has layers, or shapes that do not
            match it.
        """
        layer = len(self._keys)
        if layer >= len(self._cache.keys):
            raise ValueError(
                f"The model called attention {layer + 1} times in one decoding call; the KV "
                f"cache has {len(self._cache.keys)} layers. Build the cache for this model."
            )
        slots = self._cache.keys[layer]
        b, t, kv, d = k.shape
        if (b, kv, d) != slots.shape[:3] or q.shape[2] % kv:
            raise ValueError(
                f"Keys of shape {tuple(k.shape)} ([batch, tokens, kv_heads, head_dim]) do not "
                f"fit the cache's {tuple(slots.shape)} ([batch, kv_heads, head_dim, slots]). "
                "Build the cache for this model."
            )
        dtype = slots.dtype
        keys = _write(slots, k.astype(dtype).transpose(0, 2, 3, 1), self._index, axis=3)
        values = self._cache.values[layer]
        values = _write(values, v.astype(dtype).transpose(0, 2, 1, 3), self._index, axis=2)
        self._keys.append(keys)
        self._values.append(values)
        mask = self._mask
        if isinstance(self._index, int):  # a static start (the prefill): no slot past it
            end = self._index + t
            keys, values, mask = keys[..., :end], values[:, :, :end], mask[..., :end]
        # jax.nn.dot_product_attention's XLA path, op for op (so that a token's logits are
        # the training forward's), on the cache's layout: grouped query heads [B, K, G, T, D].
        grouped = q.reshape(b, t, kv, q.shape[2] // kv, d)
        logits = jnp.einsum(
            "btkgd,bkds->bkgts", grouped, keys.astype(q.dtype), preferred_element_type=jnp.float32
        )
        logits *= jnp.asarray(1.0 / math.sqrt(d), logits.dtype)
        logits = jnp.where(mask, logits, _MASKED).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
        y = jnp.einsum("bkgts,bksd->btkgd", probs, values.astype(q.dtype))
        return y.reshape(q.shape)

    def result(self) -> KVCache:
        """The cache with this call's tokens written in every layer.

        Raises:
          ValueError: the model's call reached fewer attention layers than the cache has
            (a model that does not call :meth:`attend`, or called outside the scope).
        """
        if len(self._keys) != len(self._cache.keys):
            raise ValueError(
                f"The model's call attended over {len(self._keys)} of the cache's "
                f"{len(self._cache.keys)} layers: its attention layers must call "
                "kv_cache.current().attend(q, k, v) while decoding."
            )
        return KVCache(tuple(self._keys), tuple(self._values), self._seg_k, self._pos_k)


def _write(slots: jax.Array, new: jax.Array, index: jax.Array | int, axis: int = 1) -> jax.Array:
    """``new`` written into ``slots`` from slot ``index`` of ``axis``."""
    start: list[jax.Array | int] = [0] * slots.ndim
    start[axis] = index
    return jax.lax.dynamic_update_slice(slots, new, tuple(start))


_CURRENT: contextvars.ContextVar[Decoding | None] = contextvars.ContextVar(
    "distrain_kv_cache", default=None
)


def current() -> Decoding | None:
    """The decoding call in progress (attention layers attend through it), or ``None``:
    the ordinary forward pass."""
    return _CURRENT.get()


@contextlib.contextmanager
def decoding(
    cache: KVCache, index: jax.Array | int, segment_ids: jax.Array, positions: jax.Array
) -> Iterator[Decoding]:
    """Within the block, a model's attention layers read and write ``cache`` (see
    :class:`Decoding` for the arguments); ``.result()`` of the value it yields is the
    updated cache."""
    step = Decoding(cache, index, segment_ids, positions)
    token = _CURRENT.set(step)
    try:
        yield step
    finally:
        _CURRENT.reset(token)
