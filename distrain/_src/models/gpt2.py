"""The GPT-2 family: distrain's decoder (``transformer.py``) with learned positions.

``transformer.Transformer`` with ``positions="learned"`` is GPT-2: pre-norm blocks with
LayerNorm (weight and bias), one fused QKV projection, GELU with the tanh approximation
(``gelu_new``), learned positions and an output head tied to the token table. The fused
projection is GPT-2's ``Conv1D`` layout (``[in, out]``, no transpose), so each parameter
is one tensor of ``GPT2LMHeadModel``'s files. A rotary or mixture-of-experts
``LMConfig`` has no Hugging Face family: export refuses it.

Example:
  >>> hf = GPT2.config_to_hf(LMConfig(positions="learned", norm_eps=1e-5))
  >>> hf["model_type"], hf["layer_norm_epsilon"]
  ('gpt2', 1e-05)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, final

from flax import nnx

from distrain._src.models.family import Family, Tensor, check_keys, refuse, register
from distrain._src.models.transformer import Transformer
from distrain._src.models.transformer_config import LMConfig

_PREFIX = "transformer."
# Read and checked (or implemented) by config_from_hf.
_KEYS = {
    "vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    "tie_word_embeddings", "add_cross_attention", "summary_type", "summary_use_proj",
    "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
}  # fmt: skip
# The same GELU: transformers' NewGELU and PyTorch's tanh approximation (jax.nn.gelu's
# default, approximate=True).
_GELU = ("gelu_new", "gelu_pytorch_tanh")


@final
class GPT2Family(Family):
    name = "gpt2"
    model_types = ("gpt2",)
    # The causal-mask buffers older checkpoints hold; a tied head's copy of the table.
    ignored = (r"\.attn\.bias$", r"\.attn\.masked_bias$", r"(^|\.)lm_head\.weight$")
    prefix = _PREFIX

    def config_from_hf(self, hf: Mapping[str, Any]) -> LMConfig:
        check_keys(self.name, hf, _KEYS)
        expect = {
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "tie_word_embeddings": True,
            "add_cross_attention": False,
        }
        for key, value in expect.items():
            if hf.get(key, value) != value:
                raise refuse(self.name, key, hf[key], f"{key}={value}")
        act = hf.get("activation_function", "gelu_new")
        if act not in _GELU:
            raise refuse(self.name, "activation_function", act, " or ".join(_GELU))
        dropout = {k: hf[k] for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop") if hf.get(k)}
        if dropout:  # training-time only: the model's values are the same without it
            warnings.warn(
                f"distrain's GPT-2 applies no dropout; config.json asks for {dropout} (the "
                "model's outputs are the same; training is without dropout).",
                stacklevel=3,
            )
        return LMConfig(
            vocab_size=hf["vocab_size"],
            seq_len=hf["n_positions"],
            d_model=hf["n_embd"],
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            d_ff=hf.get("n_inner"),
            positions="learned",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        )

    def config_to_hf(self, cfg: LMConfig) -> dict[str, Any]:
        _check_exportable(cfg)
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "tie_word_embeddings": True,
        }

    def build(self, cfg: LMConfig, rngs: nnx.Rngs) -> Transformer:
        _check_exportable(cfg)
        return Transformer(cfg, rngs=rngs)

    def tensors(self, cfg: LMConfig) -> list[Tensor]:
        def layer(part: str, i: int | None) -> tuple[str, tuple[str, ...]]:
            """The leaf path and tensor names of ``part`` of block ``i`` (None: the
            stacked blocks of a pipelined model, every layer's tensor)."""
            block, hf = part.split("=")
            layers = range(cfg.n_layers) if i is None else [i]
            path = "blocks/" + ("" if i is None else f"{i}/") + block
            return path, tuple(f"{_PREFIX}h.{j}.{hf}" for j in layers)

        parts = [
            "norm1/scale=ln_1.weight", "norm1/bias=ln_1.bias",
            "attn/qkv/kernel=attn.c_attn.weight", "attn/qkv/bias=attn.c_attn.bias",
            "attn/out/kernel=attn.c_proj.weight", "attn/out/bias=attn.c_proj.bias",
            "norm2/scale=ln_2.weight", "norm2/bias=ln_2.bias",
            "mlp/fc/kernel=mlp.c_fc.weight", "mlp/fc/bias=mlp.c_fc.bias",
            "mlp/proj/kernel=mlp.c_proj.weight", "mlp/proj/bias=mlp.c_proj.bias",
        ]  # fmt: skip
        stacked = cfg.pipeline_microbatches is not None
        blocks = [Tensor(*layer(p, None)) for p in parts] if stacked else [
            Tensor(*layer(p, i)) for i in range(cfg.n_layers) for p in parts
        ]  # fmt: skip
        return [
            Tensor("embed/embedding", (_PREFIX + "wte.weight",)),
            Tensor("pos_embed/embedding", (_PREFIX + "wpe.weight",)),
            *blocks,
            Tensor("norm/scale", (_PREFIX + "ln_f.weight",)),
            Tensor("norm/bias", (_PREFIX + "ln_f.bias",)),
        ]

    def owns(self, cfg: Any) -> bool:
        return isinstance(cfg, LMConfig)


def _check_exportable(cfg: LMConfig) -> None:
    if cfg.positions != "learned":
        raise ValueError(
            f"LMConfig(positions={cfg.positions!r}) has no Hugging Face family: GPT-2 has "
            "learned positions. Train with positions='learned' to export or import GPT-2."
        )
    if cfg.moe_experts is not None:
        raise ValueError(
            f"LMConfig(moe_experts={cfg.moe_experts}) has no Hugging Face family (GPT-2 has "
            "dense MLPs; GELU experts are distrain's own). Use the Mixtral family for experts."
        )


GPT2 = register(GPT2Family())
