"""The Mixtral family (Mixtral, Qwen3-MoE): Llama's attention and a mixture of SwiGLU
experts through ``dt.nn.moe``.

Each block is Llama's (``llama.py``: RMSNorm, grouped-query attention with rotary
positions, Qwen3-MoE's q/k norms and ``head_dim``) with its MLP replaced by
``num_local_experts`` SwiGLU experts (``silu(x w_gate) * (x w_in)) w_out``). The router is
``transformers``': softmax over the router logits (float32), the ``num_experts_per_tok``
best experts, their weights divided by their sum for Mixtral and for Qwen3-MoE with
``norm_topk_prob`` (raw softmax scores without). Routing is dropless, as in
``transformers``. ``model(tokens, return_router_logits=True)`` also returns the router
logits ``[layers, B * T, E]`` ``transformers`` computes (``output_router_logits``);
``return_aux=True`` the routing statistics and ``moe_loss``: ``router_aux_loss_coef``
times ``transformers``' ``aux_loss`` (the Switch balancing loss over every layer's
tokens pooled, :func:`aux_loss`).

The files: ``transformers`` 5 holds the experts of a layer fused in memory
(``experts.gate_up_proj`` ``[E, 2F, D]``) but ``save_pretrained`` writes them back in
the original per-expert layout (``save_original_format=True``, its default), which every
published checkpoint has and which the fixtures (written by ``transformers`` 5.24) hold:
Mixtral ``model.layers.{i}.block_sparse_moe.experts.{e}.w1|w3|w2.weight`` (gate, up,
down) and ``block_sparse_moe.gate.weight`` (router); Qwen3-MoE
``model.layers.{i}.mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` and
``mlp.gate.weight``. Each is a PyTorch ``Linear`` weight ``[out, in]``; the experts of a
layer stack, transposed, into one leaf ``[E, in, out]`` (``Tensor`` with several names),
which :data:`~distrain._src.models.llama.LOGICAL_AXIS_RULES` splits over ``"expert"``.

Example:
  >>> cfg = MixtralConfig(vocab_size=96, hidden_size=32, num_attention_heads=4,
  ...                     num_local_experts=4, num_experts_per_tok=2)
  >>> logits, router_logits = Mixtral(cfg, rngs=nnx.Rngs(0))(tokens, return_router_logits=True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, final

import jax
import jax.numpy as jnp
from flax import nnx

from distrain._src.models import llama, llama_family
from distrain._src.models.family import Family, Tensor, refuse, register
from distrain._src.models.llama import Attention, Context, RMSNorm, _DecoderConfig
from distrain._src.models.transformer_layout import constrain_hidden
from distrain._src.nn.moe import moe

__all__ = ["MIXTRAL", "Mixtral", "MixtralConfig", "MixtralFamily", "aux_loss"]


@dataclasses.dataclass(frozen=True)
class MixtralConfig(_DecoderConfig):
    """A Mixtral or Qwen3-MoE model: :class:`~distrain._src.models.llama._DecoderConfig`'s
    fields (``intermediate_size`` is each expert's width) and the experts'.

    Attributes:
      num_local_experts: experts per layer.
      num_experts_per_tok: experts each token goes through (top-k).
      norm_topk_prob: divide the chosen experts' softmax scores by their sum (always
        for Mixtral; Qwen3-MoE's option).
      router_aux_loss_coef: the weight of the balancing loss in ``moe_loss``.
      dense_intermediate_size: Qwen3-MoE's ``intermediate_size``, the width of dense
        MLP layers; every layer here is sparse (others are refused), so it is only kept
        for export. ``None``: the experts' width.

    Example:
      >>> MixtralConfig(model_type="qwen3_moe", head_dim=16, norm_topk_prob=False)
    """

    model_type: str = "mixtral"
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    dense_intermediate_size: int | None = None

    model_types: ClassVar[tuple[str, ...]] = ("mixtral", "qwen3_moe")

    def __post_init__(self) -> None:
        super().__post_init__()
        e, k = self.num_local_experts, self.num_experts_per_tok
        if not llama._positive_int(e):
            raise ValueError(
                f"MixtralConfig.num_local_experts must be a positive int. Received: {e!r}."
            )
        if not llama._positive_int(k) or k > e:
            raise ValueError(
                f"MixtralConfig.num_experts_per_tok must be an int from 1 to num_local_experts "
                f"({e}). Received: {k!r}."
            )
        if self.model_type == "mixtral" and self.norm_topk_prob is not True:
            raise ValueError(
                "MixtralConfig(model_type='mixtral') always renormalizes its top-k weights; "
                f"received norm_topk_prob={self.norm_topk_prob!r}. Use model_type='qwen3_moe' "
                "for raw softmax weights."
            )
        c = self.router_aux_loss_coef
        if isinstance(c, bool) or not isinstance(c, int | float) or c < 0:
            raise ValueError(
                f"MixtralConfig.router_aux_loss_coef must be a number >= 0. Received: {c!r}."
            )
        d = self.dense_intermediate_size
        if d is not None and not llama._positive_int(d):
            raise ValueError(
                "MixtralConfig.dense_intermediate_size must be a positive int or None. "
                f"Received: {d!r}."
            )


class MoE(nnx.Module):
    """``num_local_experts`` SwiGLU experts, ``num_experts_per_tok`` per token; returns
    ``(y, statistics, router logits [tokens, E])``."""

    def __init__(self, cfg: MixtralConfig, *, rngs: nnx.Rngs) -> None:
        e, d, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        init = nnx.initializers.normal(0.02)
        self.router = nnx.Param(init(rngs.params(), (d, e)), out_sharding=("embed", None))
        expert_in = ("expert", "embed", "mlp")
        self.w_gate = nnx.Param(init(rngs.params(), (e, d, f)), out_sharding=expert_in)
        self.w_in = nnx.Param(init(rngs.params(), (e, d, f)), out_sharding=expert_in)
        self.w_out = nnx.Param(
            init(rngs.params(), (e, f, d)), out_sharding=("expert", "mlp", "embed")
        )
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
        router = self.router[...]
        params = {"router": router, "w_gate": self.w_gate[...], "w_in": self.w_in[...]}
        params["w_out"] = self.w_out[...]
        y, stats = moe(
            x,
            params,
            top_k=self.top_k,
            score="softmax",
            renormalize=self.renormalize,
            activation=jax.nn.silu,
        )
        # The same product dt.nn.moe routes by (float32), returned as transformers does.
        logits = x.reshape(-1, x.shape[-1]).astype(jnp.float32) @ router.astype(jnp.float32)
        return y, stats, logits


class Block(nnx.Module):
    """``x + attn(attn_norm(x))``, then ``x + moe(mlp_norm(x))``."""

    def __init__(self, cfg: MixtralConfig, *, rngs: nnx.Rngs) -> None:
        dtype = llama._DTYPES[cfg.dtype]
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MoE(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context) -> tuple[jax.Array, Any, jax.Array]:
        x = x + self.attn(self.attn_norm(x), ctx)
        y, stats, router_logits = self.mlp(self.mlp_norm(x))
        return x + y, stats, router_logits


class Mixtral(nnx.Module):
    """Token ids ``[B, T]`` -> float32 logits ``[B, T, vocab_size]``, then (when asked)
    the auxiliary dict and the router logits ``[layers, B * T, E]``.

    Example:
      >>> logits, aux = model(tokens, return_aux=True)
      >>> loss = task_loss + aux["moe_loss"]
    """

    def __init__(self, cfg: MixtralConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        with nnx.use_eager_sharding(False):
            self.embed = llama.embedding(cfg, rngs)
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, llama._DTYPES[cfg.dtype])
            self.head = (
                None
                if cfg.tie_word_embeddings
                else llama.linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, rngs)
            )

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        return_aux: bool = False,
        return_router_logits: bool = False,
    ) -> Any:
        ctx = llama.context(self.cfg, tokens, segment_ids, positions)
        x = self.embed(tokens)
        stats, routers = [], []
        for block in self.blocks:
            x, block_stats, router_logits = block(x, ctx)
            x = constrain_hidden(x)
            stats.append(block_stats)
            routers.append(router_logits)
        out: list[Any] = [llama.logits(self.embed, self.head, self.norm(x))]
        router = jnp.stack(routers)
        if return_aux:
            aux = {k: jnp.mean(jnp.stack([s[k] for s in stats]), axis=0) for k in stats[0]}
            aux["aux_loss"] = aux_loss(router, self.cfg.num_experts_per_tok)
            aux["moe_loss"] = self.cfg.router_aux_loss_coef * aux["aux_loss"]
            out.append(aux)
        if return_router_logits:
            out.append(router)
        return out[0] if len(out) == 1 else tuple(out)


def aux_loss(router_logits: jax.Array, top_k: int) -> jax.Array:
    """``transformers``' ``load_balancing_loss_func`` without a padding mask: over the
    tokens of every layer pooled, ``E * sum_e f_e * p_e`` with ``f_e`` the share of tokens
    whose choices include ``e`` (summed over the ``top_k`` ranks) and ``p_e`` the mean
    softmax score (``k`` times ``dt.nn.moe``'s per-layer statistic when balanced).

    Args:
      router_logits: ``[layers, tokens, E]``.
      top_k: experts per token.
    """
    e = router_logits.shape[-1]
    scores = jax.nn.softmax(router_logits.reshape(-1, e).astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(scores, top_k)
    tokens_per_expert = jnp.mean(jax.nn.one_hot(chosen, e, dtype=jnp.float32), axis=0)  # [k, E]
    return e * jnp.sum(tokens_per_expert * jnp.mean(scores, axis=0)[None])


# ----------------------------------------------------------------------------- config.json


@final
class MixtralFamily(Family):
    """``MixtralForCausalLM`` (no sliding window) and ``Qwen3MoeForCausalLM`` (every layer
    sparse)."""

    name = "mixtral"
    model_types = ("mixtral", "qwen3_moe")
    ignored = llama_family.IGNORED

    def config_from_hf(self, hf: Mapping[str, Any]) -> MixtralConfig:
        r = llama_family.Reader(self.name, hf)
        kwargs = llama_family.read_decoder(r)
        llama_family.read_sliding_window(r)
        # transformers 5 writes num_local_experts; 4 (and Qwen3-MoE's hub files) num_experts.
        names = [k for k in ("num_local_experts", "num_experts") if k in hf]
        if len({hf[k] for k in names}) > 1:
            expected = f"the value of num_local_experts={hf['num_local_experts']!r}"
            raise refuse(self.name, "num_experts", hf["num_experts"], expected)
        experts = r.get(names[0] if names else "num_local_experts")
        r.read.update(names)
        r.get("output_router_logits", False)  # what transformers returns, not what it computes
        qwen = r.model_type == "qwen3_moe"
        if qwen:
            r.expect("decoder_sparse_step", (1,), "every layer sparse (decoder_sparse_step=1)")
            only = r.get("mlp_only_layers", None)
            if only:
                raise refuse(self.name, "mlp_only_layers", only, "every layer sparse ([])")
            kwargs["dense_intermediate_size"] = kwargs["intermediate_size"]
            kwargs["intermediate_size"] = r.get("moe_intermediate_size")
            norm = r.expect("norm_topk_prob", (False, True), "True or False")
        else:
            norm = True
            jitter = r.get("router_jitter_noise", 0.0)
            if jitter != 0:
                raise refuse(self.name, "router_jitter_noise", jitter, "router_jitter_noise=0.0")
        top_k = r.get("num_experts_per_tok")
        coef = r.get("router_aux_loss_coef", 0.001)
        r.done()
        return MixtralConfig(
            **kwargs,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=norm,
            router_aux_loss_coef=coef,
        )

    def config_to_hf(self, cfg: MixtralConfig) -> dict[str, Any]:
        hf = llama_family.decoder_to_hf(cfg)
        hf.update(
            num_local_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
        if cfg.model_type == "qwen3_moe":
            hf.update(
                num_experts=cfg.num_local_experts,  # transformers 4's name
                intermediate_size=cfg.dense_intermediate_size or cfg.intermediate_size,
                moe_intermediate_size=cfg.intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        else:
            hf["router_jitter_noise"] = 0.0
        return hf

    def build(self, cfg: MixtralConfig, rngs: nnx.Rngs) -> Mixtral:
        return Mixtral(cfg, rngs=rngs)

    def tensors(self, cfg: MixtralConfig) -> list[Tensor]:
        before, after = llama_family.outer_tensors(cfg)
        qwen = cfg.model_type == "qwen3_moe"
        moe_name = "mlp" if qwen else "block_sparse_moe"
        # (leaf, tensor of expert e): gate, up, down.
        experts = (
            {"w_gate": "gate_proj", "w_in": "up_proj", "w_out": "down_proj"}
            if qwen
            else {"w_gate": "w1", "w_in": "w3", "w_out": "w2"}
        )
        blocks = []
        for i in range(cfg.num_hidden_layers):
            n = f"model.layers.{i}.{moe_name}."
            blocks += llama_family.attention_tensors(cfg, i)
            blocks.append(Tensor(f"blocks/{i}/mlp/router", (n + "gate.weight",), transpose=True))
            blocks += [
                Tensor(
                    f"blocks/{i}/mlp/{leaf}",
                    tuple(f"{n}experts.{e}.{hf}.weight" for e in range(cfg.num_local_experts)),
                    transpose=True,
                )
                for leaf, hf in experts.items()
            ]
        return [*before, *blocks, *after]

    def owns(self, cfg: Any) -> bool:
        return isinstance(cfg, MixtralConfig)


MIXTRAL = register(MixtralFamily())
