"""The Llama family (Llama, Mistral without a sliding window, Qwen3) in flax NNX.

Pre-norm decoder blocks as ``transformers``' ``LlamaForCausalLM`` computes them: RMSNorm
(``x * rsqrt(mean(x^2) + eps) * weight``, in float32), causal grouped-query attention
(``num_key_value_heads`` K/V heads shared by ``num_attention_heads`` query heads, through
``dt.nn.dot_product_attention``), rotary positions with ``rope_theta`` and the
``rope_scaling`` types ``linear`` and ``llama3`` (frequencies computed in float32 as
``transformers``' ``modeling_rope_utils`` does), a SwiGLU MLP (``down(silu(gate(x)) *
up(x))``) and an output head tied to the token table or not. Qwen3 adds an RMSNorm over
each head of q and k (``q_norm`` / ``k_norm``) and a ``head_dim`` independent of
``hidden_size / num_attention_heads``.

Every parameter carries logical axis names (``"vocab"``, ``"embed"``, ``"heads"``,
``"kv_heads"``, ``"mlp"``, ``"expert"``); :data:`LOGICAL_AXIS_RULES` maps them to a
replica mesh Megatron-style (heads and the MLP's hidden units over ``"tensor"``, every
kernel's other dimension over ``"fsdp"``), and :func:`layout_for` gives a strategy both
(``layout=``, ``logical_axis_rules=``), leaving whole what a mesh axis does not divide.

``llama_family.py`` maps ``config.json`` to :class:`LlamaConfig` (refusing every field it
does not implement, by name) and each parameter to its tensor in the files.

Example:
  >>> cfg = LlamaConfig(vocab_size=96, hidden_size=32, num_attention_heads=4)
  >>> model = Llama(cfg, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 8), jnp.int32)).shape          # float32 logits
  (2, 8, 96)
  >>> layout, rules = layout_for(cfg, {"fsdp": 4, "tensor": 2})
  >>> dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2},
  ...                     layout=layout, logical_axis_rules=rules)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distrain._src.models import kv_cache
from distrain._src.models.family import family_of
from distrain._src.models.transformer import apply_rope
from distrain._src.models.transformer_layout import constrain_hidden
from distrain._src.nn.attention import dot_product_attention
from distrain._src.strategy.rules import OrderedAxisRules

__all__ = ["LOGICAL_AXIS_RULES", "Llama", "LlamaConfig", "RopeScaling", "layout_for"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

#: Logical axis names -> mesh axes, in priority order (``dt.OrderedAxisRules``: a name
#: whose axis the replica lacks stays whole, so one table serves every mesh).
LOGICAL_AXIS_RULES = OrderedAxisRules(
    [
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("expert", "expert"),
    ]
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` (``rope_parameters`` in ``transformers`` 5): how the rotary
    frequencies are stretched past the pretraining context.

    Attributes:
      rope_type: ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"``
        (Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth
        ramp between).
      factor: the stretch.
      low_freq_factor: llama3: wavelengths above ``original / low_freq_factor`` are
        divided by ``factor``.
      high_freq_factor: llama3: wavelengths below ``original / high_freq_factor`` are kept.
      original_max_position_embeddings: llama3: the pretraining context.
    """

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"RopeScaling.rope_type must be 'linear' or 'llama3'. Received: {self.rope_type!r}."
            )
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0. Received: {self.factor!r}.")
        llama3 = (
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        )
        if self.rope_type == "llama3" and (
            None in llama3 or not 0 < llama3[0] < llama3[1]  # type: ignore[operator]
        ):
            raise ValueError(
                "RopeScaling(rope_type='llama3') needs 0 < low_freq_factor < high_freq_factor "
                f"and original_max_position_embeddings. Received: {self}."
            )


@dataclasses.dataclass(frozen=True)
class _DecoderConfig:
    """The fields Llama and Mixtral share (``transformers``' names); build a
    :class:`LlamaConfig` or a ``MixtralConfig``.

    Attributes:
      model_type: ``config.json``'s ``model_type``, which export writes back.
      vocab_size: number of token ids.
      hidden_size: width of the residual stream.
      intermediate_size: hidden width of the MLP (of each expert in Mixtral).
      num_hidden_layers: decoder blocks.
      num_attention_heads: query heads.
      num_key_value_heads: key/value heads (grouped-query attention; a divisor of the
        query heads). ``None``: as many as query heads.
      head_dim: width of a head. ``None``: ``hidden_size // num_attention_heads``.
      rms_norm_eps: the RMSNorms' epsilon.
      rope_theta: the rotary base wavelength.
      rope_scaling: a :class:`RopeScaling`, or ``None`` (plain rotary positions).
      max_position_embeddings: the context the checkpoint declares (export writes it;
        longer inputs are computed as ``transformers`` does, without a check).
      tie_word_embeddings: the output head is the token table (no ``lm_head``).
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"``; parameters stay as created
        or imported, logits are float32.
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"

    #: The ``model_type`` values this config class accepts.
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen3")

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.model_type not in self.model_types:
            raise ValueError(
                f"{name}.model_type must be one of {list(self.model_types)}. "
                f"Received: {self.model_type!r}."
            )
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None and _positive_int(self.num_attention_heads):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for field in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, field)
            if not _positive_int(value):
                raise ValueError(f"{name}.{field} must be a positive int. Received: {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:  # type: ignore[operator]
            raise ValueError(
                f"{name}.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads}): each K/V head serves a "
                "group of query heads."
            )
        if self.head_dim % 2:  # type: ignore[operator]
            raise ValueError(
                f"{name}.head_dim must be even (rotary positions turn pairs). Received: "
                f"{self.head_dim}."
            )
        for field in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}.{field} must be a number > 0. Received: {value!r}.")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"{name}.rope_scaling must be a RopeScaling or None. Received: "
                f"{self.rope_scaling!r}."
            )
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"{name}.dtype must be one of {sorted(_DTYPES)}. Received: {self.dtype!r}."
            )

    @property
    def qk_norm(self) -> bool:
        """Qwen3's RMSNorm over each head of q and k."""
        return self.model_type.startswith("qwen3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(_DecoderConfig):
    """A Llama, Mistral (no sliding window) or Qwen3 model (:class:`_DecoderConfig`'s
    fields; ``model_type="qwen3"`` adds the q/k norms).

    Example:
      >>> LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2).head_dim
      16
    """


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# ----------------------------------------------------------------------------- rotary


def rope_frequencies(cfg: _DecoderConfig) -> np.ndarray:
    """The rotary inverse frequencies ``[head_dim // 2]``, float32, as ``transformers``
    computes them for the config's ``rope_scaling`` (its float32 arithmetic, step by step,
    so the angles agree to the bit where the operations do)."""
    f32 = np.float32
    dim = cfg.head_dim or 0
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    inv = f32(1.0) / (f32(cfg.rope_theta) ** exponents)
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / f32(s.factor)
    # llama3: wavelengths past the original context's low-frequency bound are divided by
    # the factor, those under the high-frequency bound kept, the band between blended.
    old, low, high = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    assert old is not None and low is not None and high is not None  # RopeScaling checked
    wavelen = f32(2 * math.pi) / inv
    scaled = np.where(wavelen > f32(old / low), inv / f32(s.factor), inv)
    smooth = (f32(old) / wavelen - f32(low)) / f32(high - low)
    blended = (f32(1.0) - smooth) * scaled / f32(s.factor) + smooth * scaled
    medium = ~(wavelen < f32(old / high)) & ~(wavelen > f32(old / low))
    return np.where(medium, blended, scaled).astype(f32)


def rope_tables(cfg: _DecoderConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` ``[B, T, head_dim // 2]`` for ``positions`` ``[B, T]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(cfg))
    return jnp.cos(angles), jnp.sin(angles)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """What every block reads besides the residual stream."""

    rope: tuple[jax.Array, jax.Array]
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None


def context(cfg: _DecoderConfig, tokens: jax.Array, segment_ids: Any, positions: Any) -> Context:
    """The blocks' :class:`Context` for ``tokens`` ``[B, T]`` (positions ``0..T-1``
    unless given)."""
    pos = (
        positions
        if positions is not None
        else jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    )
    return Context(rope_tables(cfg, pos), segment_ids, positions)


# ----------------------------------------------------------------------------- layers


def _init(names: tuple[str | None, ...]) -> Any:
    return nnx.with_partitioning(nnx.initializers.normal(0.02), names)


def linear(
    d_in: int, d_out: int, names: tuple[str, str], cfg: _DecoderConfig, rngs: nnx.Rngs
) -> nnx.Linear:
    """A bias-free ``nnx.Linear`` whose kernel ``[d_in, d_out]`` has logical ``names``."""
    return nnx.Linear(
        d_in, d_out, use_bias=False, kernel_init=_init(names), dtype=_DTYPES[cfg.dtype], rngs=rngs
    )


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * scale`` over the last axis, normalised in float32
    (``LlamaRMSNorm``); the scale is replicated (tiny)."""

    def __init__(self, size: int, eps: float, dtype: Any) -> None:
        self.scale = nnx.Param(jnp.ones((size,), jnp.float32), out_sharding=(None,))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * y.astype(self.dtype)


class Attention(nnx.Module):
    """Causal grouped-query attention with rotary positions (and Qwen3's q/k norms)."""

    def __init__(self, cfg: _DecoderConfig, *, rngs: nnx.Rngs) -> None:
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        assert k is not None and h is not None  # _DecoderConfig resolved them
        self.n, self.kv, self.h = n, k, h
        self.q = linear(d, n * h, ("embed", "heads"), cfg, rngs)
        self.k = linear(d, k * h, ("embed", "kv_heads"), cfg, rngs)
        self.v = linear(d, k * h, ("embed", "kv_heads"), cfg, rngs)
        self.o = linear(n * h, d, ("heads", "embed"), cfg, rngs)
        dtype = _DTYPES[cfg.dtype]
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def __call__(self, x: jax.Array, ctx: Context) -> jax.Array:
        b, t, _ = x.shape
        q = self.q(x).reshape(b, t, self.n, self.h)
        k = self.k(x).reshape(b, t, self.kv, self.h)
        v = self.v(x).reshape(b, t, self.kv, self.h)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, pre-rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *ctx.rope), apply_rope(k, *ctx.rope)
        decode = kv_cache.current()
        if decode is not None:  # dt.models.generate: the new tokens over the KV cache
            return self.o(decode.attend(q, k, v).reshape(b, t, self.n * self.h))
        y = dot_product_attention(
            q, k, v, is_causal=True, segment_ids=ctx.segment_ids, positions=ctx.positions
        )
        return self.o(y.reshape(b, t, self.n * self.h))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: _DecoderConfig, *, rngs: nnx.Rngs) -> None:
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate = linear(d, f, ("embed", "mlp"), cfg, rngs)
        self.up = linear(d, f, ("embed", "mlp"), cfg, rngs)
        self.down = linear(f, d, ("mlp", "embed"), cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        dtype = _DTYPES[cfg.dtype]
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), ctx)
        return x + self.mlp(self.mlp_norm(x))


def embedding(cfg: _DecoderConfig, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(
        cfg.vocab_size,
        cfg.hidden_size,
        embedding_init=_init(("vocab", "embed")),
        dtype=_DTYPES[cfg.dtype],
        rngs=rngs,
    )


def logits(embed: nnx.Embed, head: nnx.Linear | None, x: jax.Array) -> jax.Array:
    """The head (the token table when tied) in the compute dtype; logits float32."""
    return (embed.attend(x) if head is None else head(x)).astype(jnp.float32)


class Llama(nnx.Module):
    """Token ids ``[B, T]`` -> float32 logits ``[B, T, vocab_size]``; optional
    ``segment_ids`` / ``positions`` ``[B, T]`` for packed or reordered rows (as
    ``dt.models.Transformer``).

    Parameters are created float32 with their logical axis names as metadata only
    (``nnx.use_eager_sharding(False)``): a strategy places them (:func:`layout_for`).
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        with nnx.use_eager_sharding(False):
            self.embed = embedding(cfg, rngs)
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, _DTYPES[cfg.dtype])
            self.head = (
                None
                if cfg.tie_word_embeddings
                else linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, rngs)
            )

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        ctx = context(self.cfg, tokens, segment_ids, positions)
        x = self.embed(tokens)
        for block in self.blocks:
            x = constrain_hidden(block(x, ctx))
        return logits(self.embed, self.head, self.norm(x))


# ----------------------------------------------------------------------------- layout


def layout_for(
    cfg_or_module: _DecoderConfig | nnx.Module,
    devices_per_replica: Mapping[str, int] | None = None,
) -> tuple[Any, OrderedAxisRules]:
    """``(layout, logical_axis_rules)`` for a strategy: the parameters' logical specs (a
    pure dict with the parameters' structure) and :data:`LOGICAL_AXIS_RULES`.

    With ``devices_per_replica``, a logical name whose mesh axis does not divide what it
    names stays whole instead of failing the strategy's check (a vocabulary of 50257
    over ``"tensor": 2``) or splitting inside a head (one K/V head over ``"tensor": 2``:
    heads are split whole, so the attention of a head stays on one device).

    Example:
      >>> layout, rules = layout_for(cfg, {"fsdp": 4, "tensor": 2})
      >>> dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2},
      ...                     layout=layout, logical_axis_rules=rules)
    """
    if isinstance(cfg_or_module, nnx.Module):
        module, cfg = cfg_or_module, getattr(cfg_or_module, "cfg", None)
    else:
        family, cfg = family_of(cfg_or_module), cfg_or_module
        module = nnx.eval_shape(lambda: family.build(cfg, nnx.Rngs(0)))
    state = nnx.state(module, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    if devices_per_replica is None:
        return specs, LOGICAL_AXIS_RULES
    shapes = {
        tuple(p): x.shape
        for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    }
    head = getattr(cfg, "head_dim", None) or 1
    units: dict[str, list[int]] = {}  # what each name's split must keep whole: heads, rows
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]:
        for name, dim in zip(spec, shapes[tuple(path)], strict=False):
            if name is not None:
                units.setdefault(name, []).append(dim // head if "heads" in name else dim)
    table = []
    for name, axis in LOGICAL_AXIS_RULES.table:
        n = math.prod(devices_per_replica.get(a, 0) for a in axis) if axis else 1
        fits = n > 0 and all(d % n == 0 for d in units.get(name, []))
        table.append((name, axis if fits else None))
    return specs, OrderedAxisRules(table)


def _is_spec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)
