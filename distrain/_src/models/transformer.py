"""A decoder-only transformer in flax NNX, from ~1M parameters to GPT-2 small.

Pre-norm blocks (``x + attn(norm(x))``, ``x + mlp(norm(x))``), causal self-attention
through ``dt.nn.dot_product_attention`` (``jax.nn.dot_product_attention`` where the
sequence is whole: XLA on CPU, cuDNN's fused kernel on a GPU with bf16 inputs; ring
attention where the replica splits the sequence over ``"context"``), rotary or learned
positions, a GELU MLP and an output head tied to the token embedding (as GPT-2).

Packed rows (several documents per row) pass ``segment_ids`` and ``positions``
(``[B, T]``): attention stays inside a document and positions restart with it; a
load-balanced row (``dt.nn.load_balance``) passes its permuted positions the same way.
``remat`` recomputes each block's activations in the backward pass by a
``jax.checkpoint_policies`` policy (see :data:`REMAT_POLICIES`).

``moe_experts=E`` replaces each block's MLP by a mixture of ``E`` GELU experts
(``dt.nn.moe``, ``moe_top_k`` per token, dropless unless ``moe_capacity_factor``; an
optional shared expert): lay the experts out with :data:`EXPERT_LAYOUT` on a replica with
an ``"expert"`` axis. ``model(tokens, return_aux=True)`` also returns the routing
statistics, averaged over the blocks, and ``moe_loss``, the weighted auxiliary loss the
step adds.

``pipeline_microbatches=M`` stacks the blocks (one leading layer dimension, the
``nnx.vmap`` / ``lax.scan`` layout) and runs them through ``dt.nn.pipeline``: a scan over
the layers on a replica without a ``"stage"`` axis, GPipe over its stages with one (lay
the stacked blocks out with :func:`pipeline_layout`). Embedding and head stay outside.

The configuration (:class:`LMConfig`, its checks and :data:`REMAT_POLICIES`) is
``transformer_config.py``; the layout rules and :func:`constrain_hidden` are
``transformer_layout.py``.

Parameters are float32; ``dtype="bfloat16"`` runs the matmuls and attention in bf16
(mixed precision) and computes the logits and the loss in float32.

The model crosses the step boundary as ``(graphdef, params)``: ``nnx.split`` once, a
pure dict of arrays in the ``dt.TrainState``, ``nnx.merge`` inside the step
(:func:`apply_fn`), so the state is an ordinary pytree that checkpoints and shards.

Example:
  >>> cfg = LMConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128)
  >>> model = Transformer(cfg, rngs=nnx.Rngs(0))
  >>> logits = model(jnp.zeros((2, 128), jnp.int32))     # [2, 128, 256] float32
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distrain._src.models import kv_cache
from distrain._src.models.moe_block import MoE, moe_aux
from distrain._src.models.transformer_config import DTYPES, REMAT_POLICIES, LMConfig

# Re-exported for `distrain.models` (its public names): their homes are
# transformer_config.py and transformer_layout.py.
from distrain._src.models.transformer_layout import EXPERT_LAYOUT as EXPERT_LAYOUT
from distrain._src.models.transformer_layout import (
    TENSOR_PARALLEL_LAYOUT as TENSOR_PARALLEL_LAYOUT,
)
from distrain._src.models.transformer_layout import constrain_hidden
from distrain._src.models.transformer_layout import pipeline_layout as pipeline_layout
from distrain._src.nn.attention import dot_product_attention
from distrain._src.nn.pipeline_stages import pipeline

__all__ = [
    "EXPERT_LAYOUT",
    "REMAT_POLICIES",
    "TENSOR_PARALLEL_LAYOUT",
    "LMConfig",
    "constrain_hidden",
    "Transformer",
    "apply_rope",
    "count_params",
    "flops_per_token",
    "make_apply_fn",
    "pipeline_layout",
    "rope_tables",
    "transformer",
]


def rope_tables(positions: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of shape ``[B, T, head_dim // 2]`` for ``positions`` ``[B, T]``
    (RoFormer's frequencies)."""
    inv = 1.0 / (10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates pairs (first half, second half) of ``x`` ``[B, T, H, D]`` by position."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """What every block reads besides the residual stream (``None``: not given)."""

    rope: tuple[jax.Array, jax.Array] | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None


class Attention(nnx.Module):
    """Causal multi-head self-attention with one fused QKV projection."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        dt = DTYPES[cfg.dtype]
        init = nnx.initializers.normal(0.02)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers) at init.
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        self.cfg = cfg
        self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, kernel_init=init, dtype=dt, rngs=rngs)
        self.out = nnx.Linear(cfg.d_model, cfg.d_model, kernel_init=out_init, dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context) -> jax.Array:
        b, t, _ = x.shape
        cfg = self.cfg
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, cfg.n_heads, cfg.head_dim), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, T, H, D]
        if ctx.rope is not None:
            q, k = apply_rope(q, *ctx.rope), apply_rope(k, *ctx.rope)
        decode = kv_cache.current()
        if decode is not None:  # dt.models.generate: the new tokens over the KV cache
            return self.out(decode.attend(q, k, v).reshape(b, t, cfg.d_model))
        # The sequence whole: jax.nn.dot_product_attention (cuDNN flash attention on a
        # GPU when the dtype and head size allow). Split over "context": ring attention.
        y = dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            segment_ids=ctx.segment_ids,
            positions=ctx.positions,
            implementation=cfg.attention,
        )
        return self.out(y.reshape(b, t, cfg.d_model))


class MLP(nnx.Module):
    """``Linear(d, ff) -> GELU -> Linear(ff, d)``."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        dt = DTYPES[cfg.dtype]
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        self.fc = nnx.Linear(
            cfg.d_model, cfg.ff, kernel_init=nnx.initializers.normal(0.02), dtype=dt, rngs=rngs
        )
        self.proj = nnx.Linear(cfg.ff, cfg.d_model, kernel_init=out_init, dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
    """Pre-norm transformer block; a mixture-of-experts block also returns its routing
    statistics."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        dt = DTYPES[cfg.dtype]
        self.norm1 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm2 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, rngs=rngs)
        self.mlp: MLP | MoE = (
            MoE(cfg, rngs=rngs, shared=_shared_expert(cfg, rngs))
            if cfg.moe_experts
            else MLP(cfg, rngs=rngs)
        )

    def __call__(self, x: jax.Array, ctx: Context) -> Any:
        x = x + self.attn(self.norm1(x), ctx)
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(self.norm2(x))
            return x + y, stats
        return x + self.mlp(self.norm2(x))


class Transformer(nnx.Module):
    """Token ids ``[B, T]`` (``T <= seq_len``) -> float32 logits ``[B, T, vocab_size]``;
    optional ``segment_ids`` / ``positions`` ``[B, T]`` for packed or reordered rows."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        dt = DTYPES[cfg.dtype]
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=nnx.initializers.normal(0.02),
            dtype=dt,
            rngs=rngs,
        )
        self.pos_embed = (
            nnx.Embed(
                cfg.seq_len,
                cfg.d_model,
                embedding_init=nnx.initializers.normal(0.01),
                dtype=dt,
                rngs=rngs,
            )
            if cfg.positions == "learned"
            else None
        )
        if cfg.pipeline_microbatches is None and not cfg.scan_layers:
            self.blocks: Any = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        else:  # one Block whose parameters have a leading layer dimension

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs)

            self.blocks = stacked(rngs)
        self.norm = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dt, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        return_aux: bool = False,
    ) -> Any:
        cfg = self.cfg
        t = tokens.shape[-1]
        if t > cfg.seq_len:
            raise ValueError(
                f"The model attends over at most seq_len={cfg.seq_len} tokens; received a "
                f"sequence of {t}. Crop the input or build the model with a larger seq_len."
            )
        x = self.embed(tokens)
        pos = jnp.broadcast_to(jnp.arange(t), tokens.shape) if positions is None else positions
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(pos)
        else:
            rope = rope_tables(pos, cfg.head_dim)
        ctx = Context(rope, segment_ids, positions)
        stats: dict[str, jax.Array] = {}  # a mixture of experts': [n_layers, ...] each
        if cfg.pipeline_microbatches is not None:
            x = self._pipelined(x, ctx)
        elif cfg.scan_layers:
            x, stats = self._scanned(x, ctx)
        else:
            call, per_block = _remat(cfg.remat), []
            for block in self.blocks:
                out = call(block, x, ctx)
                if cfg.moe_experts:
                    out, block_stats = out
                    per_block.append(block_stats)
                x = constrain_hidden(out)
            if per_block:
                stats = {k: jnp.stack([s[k] for s in per_block]) for k in per_block[0]}
        # The tied head in the compute dtype; logits (and so the loss) in float32.
        logits = self.embed.attend(self.norm(x)).astype(jnp.float32)
        return (logits, moe_aux(cfg, stats)) if return_aux else logits

    def _scanned(self, x: jax.Array, ctx: Context) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The stacked blocks by one ``lax.scan`` (each under ``remat``'s policy); a
        mixture of experts' statistics come out stacked, one row per block."""
        cfg = self.cfg
        graphdef, params = nnx.split(self.blocks)

        def layer(h: jax.Array, p: Any) -> tuple[jax.Array, Any]:
            out = nnx.merge(graphdef, p)(h, ctx)
            h, block_stats = out if cfg.moe_experts else (out, {})
            return constrain_hidden(h), block_stats

        policy = REMAT_POLICIES[cfg.remat]
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy())
        return jax.lax.scan(layer, x, params)

    def _pipelined(self, x: jax.Array, ctx: Context) -> jax.Array:
        """The stacked blocks through ``dt.nn.pipeline``; ``ctx`` (per row) goes with
        each microbatch as its ``aux``."""
        cfg = self.cfg
        graphdef, params = nnx.split(self.blocks)

        def layer(p: Any, h: jax.Array, c: Context) -> jax.Array:
            return nnx.merge(graphdef, p)(h, c)

        policy = REMAT_POLICIES[cfg.remat]
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy())
        return pipeline(
            layer,
            params,
            x,
            microbatches=cfg.pipeline_microbatches or 1,
            repeats=cfg.pipeline_repeats,
            aux=ctx,
        )


def _call_block(block: Block, x: jax.Array, ctx: Context) -> Any:
    return block(x, ctx)


def _shared_expert(cfg: LMConfig, rngs: nnx.Rngs) -> Callable[[], MLP] | None:
    return (lambda: MLP(cfg, rngs=rngs)) if cfg.moe_shared_expert else None


def _remat(name: str) -> Callable[[Block, jax.Array, Context], Any]:
    """The block call under ``nnx.remat`` with policy ``name`` (plain for "none")."""
    policy = REMAT_POLICIES[name]
    if policy is None:
        return _call_block
    return nnx.remat(_call_block, policy=policy())


def transformer(*, key: jax.Array, **kwargs: Any) -> Transformer:
    """``model.fn`` for ``distrain train``: ``Transformer(LMConfig(**kwargs))``."""
    return Transformer(LMConfig(**kwargs), rngs=nnx.Rngs(params=key))


def make_apply_fn(graphdef: nnx.GraphDef) -> Callable[..., Any]:
    """``apply_fn(params, tokens, segment_ids=None, positions=None, return_aux=False) ->
    logits`` (``(logits, aux)`` with ``return_aux``) for ``graphdef, params =
    nnx.split(model)``."""

    def apply_fn(
        params: Any,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        return_aux: bool = False,
    ) -> Any:
        return nnx.merge(graphdef, params)(tokens, segment_ids, positions, return_aux)

    return apply_fn


def count_params(cfg: LMConfig) -> dict[str, int]:
    """Parameter counts from the shapes (no arrays allocated).

    Returns ``{"total": ..., "position": ..., "matmul": ..., "expert": ...}``:
    ``position`` is the learned position table (0 with rope), ``matmul`` the
    parameters that take part in a matrix product per token: total - position, and of a
    mixture of experts' ``expert`` parameters only the ``moe_top_k / moe_experts`` a
    token uses (the token table takes part, as the tied output head; norms and biases
    are counted too, a <0.1% overestimate).
    """
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    position = cfg.seq_len * cfg.d_model if cfg.positions == "learned" else 0
    expert = 2 * cfg.n_layers * (cfg.moe_experts or 0) * cfg.d_model * cfg.ff
    active = expert * cfg.moe_top_k // cfg.moe_experts if cfg.moe_experts else 0
    return {
        "total": total,
        "position": position,
        "matmul": total - position - expert + active,
        "expert": expert,
    }


def flops_per_token(cfg: LMConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: ``6 * N + 12 * n_layers * seq_len * d_model``.

    ``N`` is ``count_params(cfg)["matmul"]``: each such parameter costs 2 FLOPs per
    token forward and 4 backward. The second term is attention (``Q K^T`` and
    ``A V``: ``4 * T * d`` per layer forward, x3 with the backward), counted over the
    full ``T x T`` square as PaLM (appendix B) and nanoGPT do, although a causal kernel
    can skip half of it. MFU computed from this is comparable with theirs.
    """
    t = cfg.seq_len if seq_len is None else seq_len
    return 6.0 * count_params(cfg)["matmul"] + 12.0 * cfg.n_layers * t * cfg.d_model
