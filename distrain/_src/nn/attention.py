"""Attention over a sequence that may be split over the replica's ``"context"`` axis.

:func:`dot_product_attention` is the one op a model calls. Where it runs decides
what it does:

* no ``"context"`` axis of size > 1 in the context mesh (plain ``jax.jit``, a strategy
  without that axis, a replica whose sequence is whole): ``jax.nn.dot_product_attention``
  with a mask built from positions and segment ids (XLA on CPU/TPU; cuDNN on a GPU
  where it applies);
* inside a step whose replica has ``devices_per_replica={..., "context": C}``: a
  ``shard_map`` manual over ``"context"`` only (the replica's other axes stay with
  XLA's partitioner), each device holding ``T / C`` of the sequence of q, k and v:

  - ``"ring"`` (default): K/V blocks, with their positions and segment ids, travel
    around the axis with ``ppermute`` in ``C - 1`` hops; each device merges the blocks
    into its queries' output with an online softmax in float32. The next hop is issued
    before the current block is computed, so the transfer overlaps the compute.
    A (query half, key half) sub-block that the masks hide completely is skipped
    (``lax.cond``), which is what makes load balancing pay (see ``load_balance.py``);
  - ``"all_gather"``: K/V gathered whole on every device, then one masked attention
    of the local queries (simpler; holds the whole K/V and its ``T/C x T`` scores).

Masks come from *global* token positions and segment ids, not from where a token sits
in the array: a key is visible to a query when ``segment_q == segment_k`` and (causal)
``position_q >= position_k``. So a sequence reordered for load balancing (or packed
documents whose positions restart) is attended correctly, provided ``positions``
follow the tokens.

Gradients are JAX's autodiff through the unrolled ring (``ppermute`` transposes to
the reverse ``ppermute``); tests/test_nn_attention.py checks them against the unsplit
attention.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

__all__ = ["dot_product_attention"]

Implementation = Literal["ring", "all_gather"]
_IMPLEMENTATIONS = (None, "ring", "all_gather")
# A large finite negative rather than -inf: no inf - inf = NaN in the online softmax
# of a row that has seen only masked keys so far.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    is_causal: bool = False,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    scale: float | None = None,
    implementation: Implementation | None = None,
    axis: str = "context",
) -> jax.Array:
    """Scaled dot-product attention, split over the ``axis`` of the context mesh if any.

    Args:
      query: ``[B, T, N, D]``.
      key: ``[B, T, K, D]``, ``N`` a multiple of ``K`` (grouped-query attention).
      value: ``[B, T, K, D]``.
      is_causal: a query sees keys at positions ``<=`` its own.
      segment_ids: ``[B, T]`` ints; a query sees only keys of its own segment
        (packed documents). ``None``: one segment.
      positions: ``[B, T]`` ints, each token's position for the causal mask
        (``None``: ``0 .. T-1``). Pass them when the sequence was reordered
        (:func:`distrain.nn.load_balance`) or restarts per document.
      scale: multiplies the logits; default ``1 / sqrt(D)``.
      implementation: ``"ring"`` (default over a split sequence) or ``"all_gather"``;
        ignored where the sequence is whole.
      axis: the mesh axis that splits the sequence.

    Returns:
      ``[B, T, N, D]`` in ``query``'s dtype.

    Raises:
      ValueError: an unknown ``implementation``; shapes that do not fit together; a
        sequence length not divisible by the axis size.

    Example:
      >>> q = k = v = jnp.ones((2, 16, 4, 8))
      >>> dt.nn.dot_product_attention(q, k, v, is_causal=True).shape
      (2, 16, 4, 8)
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {list(_IMPLEMENTATIONS)}. "
            f"Received: implementation={implementation!r}."
        )
    _check_shapes(query, key, value, segment_ids, positions)
    b, t = query.shape[:2]
    size, manual = _axis(axis)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if size == 1:
        return _plain(query, key, value, is_causal, segment_ids, positions, scale)
    local_t = t if manual else t // size
    if not manual and t % size:
        raise ValueError(
            f"The sequence length {t} is not divisible by the size of the {axis!r} axis "
            f"({size}). Use a sequence length that is a multiple of {size} (pad the rows)."
        )
    if positions is None:
        start = jax.lax.axis_index(axis) * local_t if manual else 0
        positions = jnp.broadcast_to(start + jnp.arange(local_t if manual else t), (b, t))
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)
    positions, segment_ids = positions.astype(jnp.int32), segment_ids.astype(jnp.int32)
    split = _all_gather if implementation == "all_gather" else _ring

    def body(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, seg: jax.Array) -> Any:
        return split(q, k, v, pos, seg, is_causal=is_causal, scale=scale, axis=axis, size=size)

    if manual:  # already inside a shard_map manual over `axis`: local blocks
        return body(query, key, value, positions, segment_ids)
    seq = P(None, axis)
    return jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(seq, seq, seq, seq, seq),
        out_specs=seq,
        axis_names={axis},
        check_vma=False,
    )(query, key, value, positions, segment_ids)


def _axis(axis: str) -> tuple[int, bool]:
    """``(size of axis in the context mesh, whether it is manual there)``; size 1 when
    there is no context mesh or it lacks the axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return 1, False
    manual = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis] == AxisType.Manual
    return int(mesh.shape[axis]), manual


def _check_shapes(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, pos: jax.Array | None
) -> None:
    shapes = f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"query, key and value must be [batch, seq, heads, head_dim]. Received: {shapes}."
        )
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            "key and value must have the same shape, and the batch, sequence and head_dim of "
            f"query. Received: {shapes}."
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query's heads ({q.shape[2]}) must be a multiple of key's ({k.shape[2]}). "
            f"Received: {shapes}."
        )
    for name, x in (("segment_ids", seg), ("positions", pos)):
        if x is not None and tuple(x.shape) != tuple(q.shape[:2]):
            raise ValueError(
                f"{name} must be [batch, seq] = {tuple(q.shape[:2])}. Received shape "
                f"{tuple(x.shape)}."
            )


def _visible(
    pos_q: jax.Array, seg_q: jax.Array, pos_k: jax.Array, seg_k: jax.Array, is_causal: bool
) -> jax.Array:
    """``[B, 1, Tq, Tk]`` bool: which keys each query sees."""
    mask = seg_q[:, :, None] == seg_k[:, None, :]
    if is_causal:
        mask &= pos_q[:, :, None] >= pos_k[:, None, :]
    return mask[:, None]


def _plain(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    is_causal: bool,
    seg: jax.Array | None,
    pos: jax.Array | None,
    scale: float,
) -> jax.Array:
    if seg is None and pos is None:  # jax's own causal path, cuDNN's kernel where it applies
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=is_causal, implementation=_kernel(q)
        )
    b, t = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(t), (b, t)) if pos is None else pos
    seg = jnp.zeros((b, t), jnp.int32) if seg is None else seg
    return jax.nn.dot_product_attention(
        q, k, v, mask=_visible(pos, seg, pos, seg, is_causal), scale=scale
    )


def _kernel(q: jax.Array) -> Literal["cudnn"] | None:
    """cuDNN's flash attention on NVIDIA GPUs for 16-bit inputs and head sizes it takes;
    else jax's default. That default is XLA's attention, which writes the [B, H, T, T]
    scores to memory: on an H100 the GPT-2-small step ran at 20% MFU with it (docs/lm.md)."""
    device = jax.devices()[0]
    if device.platform != "gpu" or "nvidia" not in device.device_kind.lower():
        return None
    head = q.shape[-1]
    return (
        "cudnn"
        if q.dtype in (jnp.bfloat16, jnp.float16) and head % 8 == 0 and head <= 128
        else None
    )


def _all_gather(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    seg: jax.Array,
    *,
    is_causal: bool,
    scale: float,
    axis: str,
    size: int,
) -> jax.Array:
    del size
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
    dtype = k.dtype
    if jnp.dtype(dtype).itemsize < 4 and jax.default_backend() == "cpu":
        # XLA:CPU aborts compiling the gradient's 16-bit reduce-scatter (jax 0.10.2,
        # "Invalid binary instruction opcode copy" in AllReducePromotion): gather in f32.
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    k_all, v_all, pos_k, seg_k = gather(k), gather(v), gather(pos), gather(seg)
    k_all, v_all = k_all.astype(dtype), v_all.astype(dtype)
    mask = _visible(pos, seg, pos_k, seg_k, is_causal)
    return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask, scale=scale)


# ------------------------------------------------------------------ the ring

Stats = tuple[jax.Array, jax.Array, jax.Array]  # running max, denominator, numerator


def _merge(
    stats: Stats,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
) -> Stats:
    """One key block merged into the online softmax of the queries ``q``.

    ``q`` is ``[B, Tq, K, G, D]`` (G query heads per key head), ``k``/``v``
    ``[B, Tk, K, D]``, ``mask`` ``[B, 1, Tq, Tk]``; ``stats`` are float32 ``m`` and
    ``l`` of ``[B, K, G, Tq]`` and the unnormalised output ``[B, K, G, Tq, D]``.
    """
    m, denom, acc = stats
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = mask[:, :, None]  # [B, 1, 1, Tq, Tk]
    s = jnp.where(mask, s, _MASKED)
    # The output does not depend on m (it cancels): no gradient through the max.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * denom + p.sum(-1), alpha[..., None] * acc + pv


def _ring(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    seg: jax.Array,
    *,
    is_causal: bool,
    scale: float,
    axis: str,
    size: int,
) -> jax.Array:
    b, t, n, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, d)
    # Queries and keys in two halves each: a half-by-half sub-block that the masks hide
    # entirely is skipped; with load balancing each device's two halves are the mirrored
    # chunks i and 2C-1-i, so every device skips the same amount.
    halves = 2 if t % 2 == 0 else 1
    h = t // halves
    shape = (b, kh, n // kh, h)
    stats = [
        (jnp.full(shape, _MASKED), jnp.zeros(shape), jnp.zeros((*shape, d))) for _ in range(halves)
    ]
    perm = [(i, (i + 1) % size) for i in range(size)]
    block = (k, v, pos, seg)
    for hop in range(size):
        # Issue the next hop first: the transfer runs while this block is computed.
        nxt = jax.lax.ppermute(block, axis, perm) if hop < size - 1 else None
        kb, vb, pk, sk = block
        for i in range(halves):
            qs = slice(i * h, (i + 1) * h)
            for j in sorted(range(halves), key=lambda j: j != i):  # the diagonal first
                ks = slice(j * h, (j + 1) * h)
                mask = _visible(pos[:, qs], seg[:, qs], pk[:, ks], sk[:, ks], is_causal)
                args = (stats[i], qg[:, qs], kb[:, ks], vb[:, ks], mask)
                if hop == 0 and i == j:
                    # The diagonal is (nearly) always visible; merging it unconditionally
                    # also gives the stats the "varying" type of the inputs, which both
                    # branches of the conds below must share under a check_vma shard_map.
                    stats[i] = _merge(*args, scale)
                    continue
                stats[i] = jax.lax.cond(
                    mask.any(),
                    lambda st, qq, kk, vv, mm: _merge(st, qq, kk, vv, mm, scale),
                    lambda st, *_: st,
                    *args,
                )
        if nxt is not None:
            block = nxt
    outs = []
    for _, denom, acc in stats:
        # A row that saw no key (only possible for a fully masked query) gives 0.
        o = acc / jnp.where(denom == 0, 1.0, denom)[..., None]  # [B, K, G, h, D]
        outs.append(o.transpose(0, 3, 1, 2, 4).reshape(b, h, n, d))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)
