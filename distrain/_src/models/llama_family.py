"""The Llama family's ``config.json`` and tensor names (Llama, Mistral, Qwen3), and the
reader Mixtral's family shares.

:data:`LLAMA` maps ``config.json`` to :class:`~distrain._src.models.llama.LlamaConfig`
(every field read and checked, or refused by name; a field a file omits takes
``transformers``' default for its ``model_type``) and each parameter of
:class:`~distrain._src.models.llama.Llama` to its tensor in the files. Both spellings of
the rotary settings are read: ``rope_theta`` / ``rope_scaling`` (transformers 4) and
``rope_parameters`` (transformers 5); export writes the first, which both read.

Example:
  >>> cfg = LLAMA.config_from_hf(json.load(open("llama/config.json")))
  >>> LLAMA.tensors(cfg)[0]
  Tensor(path='embed/embedding', names=('model.embed_tokens.weight',), transpose=False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast, final

from flax import nnx

from distrain._src.models.family import Family, Tensor, check_keys, refuse, register
from distrain._src.models.llama import (
    _ARCHITECTURES,
    Llama,
    LlamaConfig,
    RopeScaling,
    _DecoderConfig,
)

# ----------------------------------------------------------------------------- config.json

_REQUIRED = object()
# transformers' class defaults of the fields a config.json may omit that change the model.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
    "qwen3": {
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 32, "head_dim": 128,
    },
    "mixtral": {
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "qwen3_moe": {
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 4,
        "num_local_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False,
        "intermediate_size": 6144, "moe_intermediate_size": 768,
    },
}  # fmt: skip


class Reader:
    """Reads ``config.json``'s fields for a family, recording each one read, so that
    :meth:`done` refuses the rest (``check_keys``)."""

    def __init__(self, family: str, hf: Mapping[str, Any]) -> None:
        self.family, self.hf = family, hf
        self.read: set[str] = set()
        self.model_type = hf.get("model_type")
        self.defaults = _DEFAULTS.get(str(self.model_type), {})

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The field's value, else transformers' default for the model type, else
        ``default``.

        Raises:
          ValueError: a required field is missing.
        """
        self.read.add(key)
        if key in self.hf:
            return self.hf[key]
        if key in self.defaults:
            return self.defaults[key]
        if default is _REQUIRED:
            raise ValueError(
                f"config.json lacks {key!r}, which distrain's {self.family} family needs "
                f"(model_type={self.model_type!r}). Add it, as transformers writes it."
            )
        return default

    def expect(self, key: str, allowed: Sequence[Any], what: str | None = None) -> Any:
        """The field, which must be one of ``allowed`` (the first is its default)."""
        value = self.get(key, allowed[0])
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise refuse(self.family, key, value, what or f"{key}={allowed[0]!r}")
        return value

    def done(self) -> None:
        check_keys(self.family, self.hf, self.read)


def read_decoder(r: Reader) -> dict[str, Any]:
    """The :class:`_DecoderConfig` fields from ``config.json`` (attention, norms, rotary,
    head), checking the fields every family of this file shares."""
    r.expect("hidden_act", ("silu",), "hidden_act='silu' (SwiGLU)")
    r.expect("attention_bias", (False,), "attention without biases")
    attention_dropout = r.get("attention_dropout", 0.0)
    if attention_dropout != 0:
        raise refuse(r.family, "attention_dropout", attention_dropout, "attention_dropout=0.0")
    r.expect("pretraining_tp", (1,))
    theta, scaling = _read_rope(r)
    return {
        "model_type": r.model_type,
        "vocab_size": r.get("vocab_size"),
        "hidden_size": r.get("hidden_size"),
        "intermediate_size": r.get("intermediate_size"),
        "num_hidden_layers": r.get("num_hidden_layers"),
        "num_attention_heads": r.get("num_attention_heads"),
        "num_key_value_heads": r.get("num_key_value_heads", None),
        "head_dim": r.get("head_dim", None),
        "rms_norm_eps": r.get("rms_norm_eps"),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": r.get("max_position_embeddings"),
        "tie_word_embeddings": r.expect("tie_word_embeddings", (False, True), "True or False"),
    }


def _read_rope(r: Reader) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from transformers 4's ``rope_theta`` and
    ``rope_scaling`` or transformers 5's ``rope_parameters`` (``rope_scaling`` wins, as
    in transformers)."""
    scaling, parameters = r.get("rope_scaling", None), r.get("rope_parameters", None)
    field = "rope_scaling" if scaling else "rope_parameters"
    rope = dict(scaling or parameters or {})
    top_theta = r.get("rope_theta")
    theta = rope.pop("rope_theta", top_theta)
    partial = rope.pop("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise refuse(r.family, "partial_rotary_factor", partial, "rotary over the whole head (1.0)")
    legacy = rope.pop("type", None)
    rope_type = rope.pop("rope_type", legacy) or "default"
    keys = {"default": (), "linear": ("factor",), "llama3": _LLAMA3_KEYS}.get(rope_type)
    if keys is None:
        raise refuse(r.family, f"{field}.rope_type", rope_type, "'default', 'linear' and 'llama3'")
    extra = sorted(set(rope) - set(keys))
    if extra:
        shown = ", ".join(f"{field}.{k}={rope[k]!r}" for k in extra)
        raise ValueError(
            f"config.json's {shown} is not implemented by distrain's {r.family} family "
            f"(rope_type {rope_type!r} reads {list(keys) or 'no other field'})."
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        rope.setdefault("original_max_position_embeddings", r.get("max_position_embeddings"))
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ValueError(
            f"config.json's {field} (rope_type {rope_type!r}) lacks {missing}; transformers "
            "requires them too."
        )
    return theta, RopeScaling(rope_type=cast(Any, rope_type), **rope)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_sliding_window(r: Reader) -> None:
    """Refuses a sliding window: Mistral's and Mixtral's ``sliding_window`` (any
    value but null), Qwen3's ``use_sliding_window`` (its ``sliding_window`` and
    ``max_window_layers`` then do nothing; ``layer_types`` must be all full)."""
    if r.model_type in ("qwen3", "qwen3_moe"):
        r.expect("use_sliding_window", (False,), "full attention in every layer")
        r.get("sliding_window", None)
        r.get("max_window_layers", None)
        layer_types = r.get("layer_types", None)
        if layer_types is not None and set(layer_types) - {"full_attention"}:
            raise refuse(r.family, "layer_types", layer_types, "'full_attention' layers only")
    else:
        r.expect("sliding_window", (None,), "full attention (sliding_window=null)")


def decoder_to_hf(cfg: _DecoderConfig) -> dict[str, Any]:
    """``config.json``'s shared fields for ``cfg``, in transformers 4's rotary spelling
    (``rope_theta``, ``rope_scaling``), which transformers 5 reads too."""
    s = cfg.rope_scaling
    scaling: dict[str, Any] | None = None
    if s is not None:
        scaling = {"rope_type": s.rope_type, "factor": s.factor}
        if s.rope_type == "llama3":
            scaling.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    hf = {
        "architectures": [_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
    }
    if cfg.model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif cfg.qk_norm:  # qwen3, qwen3_moe
        hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:  # mistral, mixtral: transformers' Mistral default is a 4096-token window
        hf["sliding_window"] = None
    return hf


def attention_tensors(cfg: _DecoderConfig, i: int) -> list[Tensor]:
    """Block ``i``'s norms and attention: leaf paths and ``LlamaForCausalLM``'s names."""
    p, n = f"blocks/{i}/", f"model.layers.{i}."
    out = [Tensor(p + "attn_norm/scale", (n + "input_layernorm.weight",))]
    out += [
        Tensor(f"{p}attn/{x}/kernel", (f"{n}self_attn.{x}_proj.weight",), transpose=True)
        for x in "qkvo"
    ]
    if cfg.qk_norm:
        out += [Tensor(f"{p}attn/{x}_norm/scale", (f"{n}self_attn.{x}_norm.weight",)) for x in "qk"]
    return [*out, Tensor(p + "mlp_norm/scale", (n + "post_attention_layernorm.weight",))]


def outer_tensors(cfg: _DecoderConfig) -> tuple[list[Tensor], list[Tensor]]:
    """The tensors before the blocks (the token table) and after (final norm, head)."""
    head = [] if cfg.tie_word_embeddings else [Tensor("head/kernel", ("lm_head.weight",), True)]
    return (
        [Tensor("embed/embedding", ("model.embed_tokens.weight",))],
        [Tensor("norm/scale", ("model.norm.weight",)), *head],
    )


#: Tensors some checkpoints hold that are no weights: old rotary buffers, and a tied
#: head's copy of the token table (transformers ties it to the table, as here).
IGNORED = (r"\.rotary_emb\.inv_freq$", r"^lm_head\.weight$")


@final
class LlamaFamily(Family):
    """``LlamaForCausalLM``, ``MistralForCausalLM`` (no sliding window) and
    ``Qwen3ForCausalLM``."""

    name = "llama"
    model_types = ("llama", "mistral", "qwen3")
    ignored = IGNORED

    def config_from_hf(self, hf: Mapping[str, Any]) -> LlamaConfig:
        r = Reader(self.name, hf)
        kwargs = read_decoder(r)
        read_sliding_window(r)
        if r.model_type == "llama":
            r.expect("mlp_bias", (False,), "an MLP without biases")
        r.done()
        return LlamaConfig(**kwargs)

    def config_to_hf(self, cfg: LlamaConfig) -> dict[str, Any]:
        return decoder_to_hf(cfg)

    def build(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> Llama:
        return Llama(cfg, rngs=rngs)

    def tensors(self, cfg: LlamaConfig) -> list[Tensor]:
        before, after = outer_tensors(cfg)
        blocks = []
        for i in range(cfg.num_hidden_layers):
            mlp = [
                Tensor(
                    f"blocks/{i}/mlp/{x}/kernel", (f"model.layers.{i}.mlp.{x}_proj.weight",), True
                )
                for x in ("gate", "up", "down")
            ]
            blocks += [*attention_tensors(cfg, i), *mlp]
        return [*before, *blocks, *after]

    def owns(self, cfg: Any) -> bool:
        return isinstance(cfg, LlamaConfig)


LLAMA = register(LlamaFamily())
