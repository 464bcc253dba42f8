"""LoRA adapters on the ``nnx.Linear`` layers of any flax NNX model (``dt.models``).

:func:`add_lora` replaces each target ``nnx.Linear`` (chosen by a regex searched in its
module path, keys joined by ``/``: ``"blocks/0/attn/q"``, ``"blocks/0/mlp/down"``,
``"blocks/0/attn/qkv"``) by a :class:`LoraLinear`: the same layer, its ``kernel`` and
``bias`` the same variables under the same names, plus ``lora_a`` ``[in, rank]`` and
``lora_b`` ``[rank, out]`` (``nnx.LoRAParam``, float32 whatever the kernel's dtype, as
PEFT keeps them), so the output is ``base(x) + dropout(x) @ lora_a @ lora_b * alpha /
rank``. ``lora_a`` starts as PEFT starts it (kaiming-uniform with ``a=sqrt(5)``: uniform
within ``1/sqrt(in)``), ``lora_b`` at zero, so the adapted model's first output is the
base model's.

The adapters carry logical axis names: ``lora_a`` the base kernel's input name and
``rank`` whole, ``lora_b`` its output name, so that ``dt.models.layout_for(module, mesh)``
and a strategy split them like the kernel they adapt (``"fsdp"`` / ``"tensor"``).

:func:`merge_lora` folds ``lora_a @ lora_b * alpha / rank`` into the kernels and returns
parameters without adapters, in the base model's structure (``dt.models.save_pretrained``
exports them). The PEFT files (``adapter_config.json`` + ``adapter_model.safetensors``) are
``peft_format.py``'s.

Why not flax's ``nnx.LoRALinear``: it builds a new kernel (the pretrained one has to be
copied in), nests the adapters under ``lora/``, has no ``alpha / rank`` scale and no
dropout, and initialises ``lora_a`` with ``he_uniform`` (bound ``sqrt(6 / in)``, PEFT's is
``sqrt(1 / in)``). :class:`LoraLinear` is an ``nnx.Linear`` subclass that keeps the
layer's own variables and calls ``nnx.Linear.__call__`` for the base output; its adapters
are flax's ``nnx.LoRAParam`` (``nnx.state(model, nnx.LoRAParam)`` selects them).

Example:
  >>> model = dt.models.Llama(cfg, rngs=nnx.Rngs(0))
  >>> dt.models.add_lora(model, dt.models.LoraConfig(rank=8, alpha=16), rngs=nnx.Rngs(1))
  >>> model.blocks[0].attn.q.lora_a.shape
  (64, 8)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar, final

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distrain._src import pytree

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "LoraLinear", "add_lora", "lora_dropout", "merge_lora"]

#: The attention projections of every family: Llama's and Mixtral's ``q``, ``k``, ``v``,
#: ``o``; GPT-2's fused ``qkv`` and ``out``.
DEFAULT_TARGETS = r"attn/(q|k|v|o|qkv|out)$"
#: The names of an adapter's two leaves (``TrainState.create(trainable=r"lora_")``).
ADAPTERS = ("lora_a", "lora_b")
M = TypeVar("M", bound=nnx.Module)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What :func:`add_lora` adds.

    Attributes:
      rank: the adapters' inner width ``r`` (PEFT's ``r``); at most ``min(in, out)`` of
        every target layer.
      alpha: the scale's numerator (PEFT's ``lora_alpha``): the update is multiplied by
        ``alpha / rank``.
      dropout: the probability of zeroing each input of the adapter (not of the base
        layer), in ``[0, 1)``; it applies inside :func:`lora_dropout` only.
      targets: a regex ``re.search``-ed in each ``nnx.Linear``'s module path (keys joined by
        ``/``): Llama and Mixtral ``blocks/{i}/attn/(q|k|v|o)``, ``blocks/{i}/mlp/(gate|up|
        down)``, ``head``; GPT-2 ``blocks/{i}/attn/(qkv|out)``, ``blocks/{i}/mlp/(fc|proj)``.
        Default: the attention projections (:data:`DEFAULT_TARGETS`).

    Example:
      >>> LoraConfig(rank=8, alpha=16, targets=r"attn/(q|v)$").scale
      2.0
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: str = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        r, a, p = self.rank, self.alpha, self.dropout
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"LoraConfig.rank must be an int >= 1. Received: {r!r}.")
        if isinstance(a, bool) or not isinstance(a, int | float) or not a > 0:
            raise ValueError(f"LoraConfig.alpha must be a number > 0. Received: {a!r}.")
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
            raise ValueError(f"LoraConfig.dropout must be a number in [0, 1). Received: {p!r}.")
        try:
            re.compile(self.targets)
        except (re.error, TypeError) as e:
            raise ValueError(
                f"LoraConfig.targets must be a regular expression. Received: "
                f"{self.targets!r} ({e})."
            ) from None

    @property
    def scale(self) -> float:
        """``alpha / rank``: what the adapters' product is multiplied by."""
        return self.alpha / self.rank


@final
class LoraLinear(nnx.Linear):
    """An ``nnx.Linear`` with adapters: ``base(x) + dropout(x) @ lora_a @ lora_b * scale``.

    Built from an existing layer (:func:`add_lora`), whose variables it keeps under their
    own names (``kernel``, ``bias``), so a pretrained model's paths, layout and export
    are unchanged. ``seed`` (from the layer's path) makes each layer's dropout mask its own.

    Example:
      >>> layer = LoraLinear(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), LoraConfig(4, 8), 0,
      ...                    rngs=nnx.Rngs(1))
      >>> layer.lora_a.shape, layer.lora_b.shape
      ((64, 4), (4, 32))
    """

    def __init__(self, base: nnx.Linear, config: LoraConfig, seed: int, *, rngs: nnx.Rngs) -> None:
        # Not nnx.Linear.__init__, which would allocate a new kernel: the layer's own
        # attributes (its variables and settings: dtype, precision, dot_general, ...).
        for name, value in vars(base).items():
            if not name.startswith("_"):
                setattr(self, name, nnx.data(None) if name == "bias" and value is None else value)
        d_in, d_out = base.kernel.shape
        meta = base.kernel.get_metadata()
        names = meta.pop("out_sharding", None)
        a_meta, b_meta = dict(meta), dict(meta)
        if names is not None:  # A split like the kernel's input, B like its output
            a_meta["out_sharding"], b_meta["out_sharding"] = (names[0], None), (None, names[1])
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)) on PEFT's [r, in] weight
        a = jax.random.uniform(rngs.params(), (d_in, config.rank), jnp.float32, -bound, bound)
        self.lora_a = nnx.LoRAParam(a, **a_meta)
        self.lora_b = nnx.LoRAParam(jnp.zeros((config.rank, d_out), jnp.float32), **b_meta)
        self.lora_scale = config.scale
        self.lora_dropout = config.dropout
        self.lora_seed = seed

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        y = super().__call__(inputs, out_sharding=out_sharding)
        x = _dropout(inputs, self.lora_dropout, self.lora_seed)
        x, a, b = self.promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        h = jnp.matmul(jnp.matmul(x, a, precision=self.precision), b, precision=self.precision)
        return y + (h * self.lora_scale).astype(y.dtype)


_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "distrain_lora_dropout", default=None
)


@contextlib.contextmanager
def lora_dropout(key: jax.Array | None) -> Iterator[None]:
    """Applies the adapters' dropout (``LoraConfig.dropout``) in the calls made inside,
    with masks drawn from ``key`` (each layer folds its own seed in). Outside it (the
    default: evaluation, export, logits) adapters run without dropout.

    Enter it inside the traced step with the step's key, so that each step draws new
    masks; a key that is a constant of a traced function is refused (every call of the
    compiled step would reuse its masks).

    Example:
      >>> def loss_fn(params, batch, key):
      ...     with dt.models.lora_dropout(key):
      ...         logits = apply_fn(params, batch["x"])
      >>> key = jax.random.fold_in(state.rng, state.step)   # in the step
    """
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def _dropout(x: jax.Array, rate: float, seed: int) -> jax.Array:
    key = _DROPOUT_KEY.get()
    if not rate or key is None:
        return x
    if isinstance(x, jax.core.Tracer) and not isinstance(key, jax.core.Tracer):
        raise ValueError(
            "dt.models.lora_dropout(key) was entered outside the traced function, so its "
            "key is a constant of the compiled program and every call would reuse the same "
            "masks. Enter it inside the step (jitted or strategy.run) with a key the step "
            "receives, e.g. jax.random.fold_in(state.rng, state.step)."
        )
    keep = jax.random.bernoulli(jax.random.fold_in(key, seed), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x)).astype(x.dtype)


def linear_paths(model: nnx.Module) -> dict[str, nnx.Linear]:
    """Every ``nnx.Linear`` of ``model`` by its module path (keys joined by ``/``)."""
    return {
        "/".join(map(str, path)): m
        for path, m in nnx.iter_modules(model)
        if isinstance(m, nnx.Linear)
    }


def add_lora(model: M, config: LoraConfig, *, rngs: nnx.Rngs) -> M:
    """Adds adapters to the ``nnx.Linear`` layers of ``model`` whose path matches
    ``config.targets``, in place (each becomes a :class:`LoraLinear` with the same
    variables).

    Args:
      model: any flax NNX model (``dt.models.Llama``, ``Mixtral``, ``Transformer``, ...);
        inside ``nnx.eval_shape`` an abstract one (for ``dt.models.layout_for``).
      config: the rank, scale, dropout and targets.
      rngs: draws ``lora_a``'s initial values.

    Returns:
      ``model`` (the same object; a bare ``nnx.Linear`` target is returned replaced).

    Raises:
      ValueError: a ``targets`` that matches no ``nnx.Linear`` (some paths are listed), a
        rank above a target's width, a target that already has adapters, or one whose
        kernel is not 2-D (stacked layers, e.g. ``LMConfig(pipeline_microbatches=...)``).
      TypeError: ``config`` is not a :class:`LoraConfig`.

    Example:
      >>> model = dt.models.add_lora(model, dt.models.LoraConfig(8, 16), rngs=nnx.Rngs(0))
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"add_lora(config=...) takes a dt.models.LoraConfig. Received: {type(config).__name__}."
        )
    linears = linear_paths(model)
    pattern = re.compile(config.targets)
    targets = {p: m for p, m in linears.items() if pattern.search(p)}
    if not targets:
        shown = ", ".join(repr(p) for p in list(linears)[:8]) or "none"
        raise ValueError(
            f"LoraConfig.targets={config.targets!r} matches no nnx.Linear of the "
            f"{type(model).__name__}; its Linear layers' paths: {shown}"
            f"{', ...' if len(linears) > 8 else ''}. Give a pattern re.search finds in one."
        )
    for path, layer in targets.items():  # every check before the model changes
        if isinstance(layer, LoraLinear):
            raise ValueError(
                f"{path!r} already has adapters: add_lora once per model (merge_lora first "
                "to start a new adapter on a merged base)."
            )
        if layer.kernel.ndim != 2:
            raise ValueError(
                f"{path!r} has a kernel of shape {layer.kernel.shape}, not [in, out] (stacked "
                "layers): LoRA adapts 2-D kernels. Build the model unstacked (e.g. without "
                "pipeline_microbatches) or leave the layer out of targets."
            )
        width = min(layer.kernel.shape)
        if config.rank > width:
            raise ValueError(
                f"LoraConfig.rank={config.rank} is above the width of {path!r} (kernel "
                f"{tuple(layer.kernel.shape)}): a low-rank update needs rank <= {width}. "
                "Lower rank, or leave the layer out of targets."
            )
    for path, layer in targets.items():
        new = LoraLinear(layer, config, zlib.crc32(path.encode()), rngs=rngs)
        if not path:
            return new  # type: ignore[return-value]  # the model is the layer itself
        _replace(model, path.split("/"), new)
    return model


def _replace(model: nnx.Module, keys: list[str], new: nnx.Module) -> None:
    parent: Any = model
    for key in keys[:-1]:
        parent = parent[int(key)] if key.isdigit() else getattr(parent, key)
    last = keys[-1]
    if last.isdigit():  # an nnx.List's entry
        parent[int(last)] = new
    else:
        setattr(parent, last, new)


def leaf_path(path: Any) -> str:
    """A leaf's path as ``Tensor.path`` spells it (flax's trailing ``/value`` left out)."""
    s = pytree.path_str(path)
    return s[: -len("/value")] if s.endswith("/value") else s


def merge_lora(params: Any, config: LoraConfig) -> Any:
    """The parameters with each adapter folded into its kernel (``kernel + lora_a @ lora_b
    * alpha / rank``, in float32, cast back to the kernel's dtype) and the adapters
    removed: the base model's structure, which ``dt.models.save_pretrained`` exports.

    Args:
      params: an ``nnx.State`` or its pure dict, or a ``dt.TrainState`` (its ``params``),
        in any layout (each kernel keeps its sharding).
      config: the adapters' :class:`LoraConfig` (its ``scale``).

    Returns:
      Parameters of the same kind (``nnx.State`` or dict) without ``lora_a`` / ``lora_b``.

    Raises:
      ValueError: no adapters in ``params``, or an adapter whose rank is not ``config``'s.

    Example:
      >>> merged = dt.models.merge_lora(state.params, lora)
      >>> dt.models.save_pretrained("merged", merged, model)
    """
    params = getattr(params, "params", params)
    found: list[str] = []

    def merge(tree: Any, path: str) -> Any:
        if not isinstance(tree, Mapping):
            return tree
        if all(k in tree for k in ("kernel", *ADAPTERS)):
            found.append(path)
            a, b = tree["lora_a"], tree["lora_b"]
            if _value(a).shape[-1] != config.rank:
                raise ValueError(
                    f"The adapter at {path!r} has rank {_value(a).shape[-1]}; the LoraConfig "
                    f"says {config.rank}. Pass the config the adapters were made with."
                )
            out = {k: v for k, v in tree.items() if k not in ADAPTERS}
            out["kernel"] = _fold(tree["kernel"], _value(a), _value(b), config.scale)
        else:
            out = {k: merge(v, f"{path}/{k}" if path else str(k)) for k, v in tree.items()}
        return nnx.State(out) if isinstance(tree, nnx.State) else out

    merged = merge(params, "")
    if not found:
        raise ValueError(
            "merge_lora found no adapters (a module with kernel, lora_a and lora_b) in the "
            "parameters: pass the parameters of a model dt.models.add_lora adapted."
        )
    return merged


def _value(x: Any) -> Any:
    return x[...] if isinstance(x, nnx.Variable) else x


def _fold(kernel: Any, a: Any, b: Any, scale: float) -> Any:
    """``kernel + a @ b * scale`` in float32, in the kernel's dtype and sharding."""
    k = _value(kernel)
    if isinstance(k, jax.Array):
        new: Any = jax.device_put(_folded(k, a, b, scale), k.sharding)  # a no-op if kept
    else:
        new = np.asarray(_folded(jnp.asarray(k), jnp.asarray(a), jnp.asarray(b), scale))
    return kernel.replace(value=new) if isinstance(kernel, nnx.Variable) else new


@functools.partial(jax.jit, static_argnums=3)  # one compilation per kernel shape and scale
def _folded(k: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    f32 = jnp.float32
    delta = jnp.matmul(a.astype(f32), b.astype(f32), precision="highest") * scale
    return (k.astype(f32) + delta).astype(k.dtype)
