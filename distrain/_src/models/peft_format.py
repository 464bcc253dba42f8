"""LoRA adapters in PEFT's format: :func:`save_adapter` and :func:`load_adapter`.

A PEFT LoRA adapter is a directory with ``adapter_config.json`` (``peft_type: "LORA"``,
``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ...) and
``adapter_model.safetensors``, whose tensors are named after the base model's module:
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]`` (PyTorch ``Linear`` weights, also for GPT-2's ``Conv1D`` modules, whose own
weight is ``[in, out]``). The module names come from the family's tensor table
(``family.tensors``: ``blocks/0/attn/q/kernel`` is ``model.layers.0.self_attn.q_proj.weight``),
so no key name of a model is written here; distrain's ``lora_a`` ``[in, r]`` and
``lora_b`` ``[r, out]`` are their transposes.

distrain adds ``distrain_base_sha256`` to ``adapter_model.safetensors``' metadata: a
hash of the base model's parameters (:func:`base_sha256`), which :func:`load_adapter`
compares with the model it loads onto (PEFT reads no metadata but the format).

Example:
  >>> dt.models.save_adapter("adapter", state, lora, model)       # model: the Pretrained
  >>> lora = dt.models.load_adapter("adapter", module)             # onto an nnx module
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from distrain._src.models import family as _family
from distrain._src.models import safetensors_io as io
from distrain._src.models.lora import (
    ADAPTERS,
    LoraConfig,
    LoraLinear,
    add_lora,
    leaf_path,
    linear_paths,
)

__all__ = ["BASE_HASH_KEY", "base_sha256", "load_adapter", "save_adapter"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
#: adapter_config.json's key for the base model's :func:`base_sha256`.
BASE_HASH_KEY = "distrain_base_sha256"
_PREFIX = "base_model.model."
_SUFFIX = {"lora_a": ".lora_A.weight", "lora_b": ".lora_B.weight"}
# adapter_config.json's fields that do not change what a loaded adapter computes (its
# origin, PEFT's bookkeeping, how it was initialised, options only read with another
# field on, and the layout PEFT merges Conv1D weights in).
_HARMLESS = frozenset(
    {
        "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights",
        "auto_mapping", "peft_version", "megatron_core", "qalora_group_size",
        "fan_in_fan_out", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    }
)  # fmt: skip


def _module_names(cfg: Any) -> tuple[_family.Family, dict[str, tuple[str, bool]]]:
    """The family of ``cfg`` and, for each of its 2-D kernels, the module path (``blocks/0/
    attn/q``) -> (the module's name in the files, whether its weight is ``[in, out]``)."""
    family = _family.family_of(cfg)
    family.config_to_hf(cfg)  # raises for a config without a Hugging Face model
    names = {}
    for t in family.tensors(cfg):
        if t.path.endswith("/kernel") and len(t.names) == 1 and t.names[0].endswith(".weight"):
            names[t.path[: -len("/kernel")]] = (t.names[0][: -len(".weight")], not t.transpose)
    return family, names


def _host(x: Any) -> np.ndarray:
    """``x`` whole, as NumPy, on every process (a collective when it spans processes)."""
    x = x[...] if isinstance(x, nnx.Variable) else x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _flat(params: Any) -> dict[str, Any]:
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    params = getattr(params, "params", params)
    return {leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def base_sha256(params: Any) -> str:
    """SHA-256 over the base model's parameters: every leaf but the adapters, in path
    order, each as its path, shape and values in float32 (so a float32 copy of a bfloat16
    checkpoint hashes as the checkpoint does; a base stored rounded, e.g. with
    ``TrainState.create(frozen_dtype=...)``, hashes as a different base).

    Args:
      params: an ``nnx.Module``, an ``nnx.State`` or its pure dict, or a ``dt.TrainState``,
        in any layout (each leaf is gathered in turn: every process must call it).

    Example:
      >>> base_sha256(model.params)
      '3f1c...'
    """
    h = hashlib.sha256()
    for path, x in sorted(_flat(params).items()):
        if path.rsplit("/", 1)[-1] in ADAPTERS:
            continue
        values = np.ascontiguousarray(_host(x), dtype="<f4")
        h.update(f"{path}:{values.shape}\n".encode())
        h.update(values.tobytes())
    return h.hexdigest()


def save_adapter(
    path: str,
    params: Any,
    lora_config: LoraConfig,
    base: Any,
    *,
    base_model_name_or_path: str | None = None,
) -> None:
    """Writes the adapters of ``params`` as a PEFT LoRA adapter: ``adapter_config.json``
    and ``adapter_model.safetensors`` (the adapters only, float32).

    Every process must call it (the adapters and the base hash are gathered from all of
    them); process 0 writes.

    Args:
      path: the directory to write (created).
      params: the adapted model's parameters (``nnx.State``, its pure dict or a
        ``dt.TrainState``), in any layout.
      lora_config: the adapters' :class:`LoraConfig` (rank, alpha, dropout).
      base: the ``dt.models.Pretrained`` the base came from, or its family's config.
      base_model_name_or_path: what PEFT loads the base from (default: the ``Pretrained``'s
        directory).

    Raises:
      ValueError: no adapters in ``params``, an adapter on a layer the family's files
        have no module for, or a rank that is not ``lora_config``'s.
      TypeError: a ``base`` no family owns.
    """
    cfg = getattr(base, "config", base)
    family, names = _module_names(cfg)
    flat = _flat(params)
    adapted = sorted(p[: -len("/lora_a")] for p in flat if p.endswith("/lora_a"))
    if not adapted:
        raise ValueError(
            "save_adapter found no adapters (…/lora_a) in the parameters: pass the "
            "parameters of a model dt.models.add_lora adapted."
        )
    unknown = [p for p in adapted if p not in names]
    if unknown:
        raise ValueError(
            f"The adapters at {unknown[:3]} adapt layers the {family.name} family's files have "
            f"no module for; PEFT can load adapters on {sorted(names)[:4]}, ...."
        )
    tensors: dict[str, np.ndarray] = {}
    for p in adapted:
        for leaf, suffix in _SUFFIX.items():
            x = _host(flat[f"{p}/{leaf}"]).astype(np.float32)
            if x.shape[-1 if leaf == "lora_a" else 0] != lora_config.rank:
                raise ValueError(
                    f"{p}/{leaf} has shape {x.shape}; the LoraConfig's rank is "
                    f"{lora_config.rank}. Pass the config the adapters were made with."
                )
            tensors[_PREFIX + names[p][0] + suffix] = np.ascontiguousarray(x.T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or getattr(base, "directory", None),
        "r": lora_config.rank,
        "lora_alpha": lora_config.alpha,
        "lora_dropout": lora_config.dropout,
        "target_modules": _target_modules([names[p][0] for p in adapted], names),
        "bias": "none",
        "fan_in_fan_out": names[adapted[0]][1],  # Conv1D ([in, out]) weights: GPT-2
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    # The base's hash goes in the file's metadata, which PEFT ignores silently (a key of
    # adapter_config.json makes it warn on every load).
    metadata = {BASE_HASH_KEY: base_sha256(flat)}
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
        # distrain's writer: its header (metadata included) comes out the same every time.
        entries = [(k, x.shape, x.dtype, lambda x=x: x) for k, x in tensors.items()]
        io.write_file(os.path.join(path, WEIGHTS), entries, metadata)
        with open(os.path.join(path, CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    multihost_utils.sync_global_devices("distrain.models.save_adapter")


def _target_modules(adapted: list[str], names: Mapping[str, tuple[str, bool]]) -> list[str]:
    """PEFT's ``target_modules``: the modules' last names (``q_proj``) when those name
    exactly the adapted modules, else their full names (PEFT matches either)."""
    short = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    if set(_targeted(short, [n for n, _ in names.values()])) == set(adapted):
        return short
    return sorted(adapted)


def _targeted(targets: Any, modules: list[str]) -> list[str]:
    """The modules PEFT adapts for ``target_modules`` (a list: a name or its last parts;
    a string: a regex the whole name matches; ``"all-linear"``: all but the output layer)."""
    if targets == "all-linear":
        return [m for m in modules if m != "lm_head"]
    if isinstance(targets, str):
        return [m for m in modules if re.fullmatch(targets, m)]
    return [m for m in modules if any(m == t or m.endswith("." + t) for t in targets)]


def _safetensors() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError("PEFT adapters are safetensors: pip install 'distrain[hf]'.") from None
    return safetensors.numpy


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG)
    if not os.path.exists(file):
        found = sorted(os.listdir(path)) if os.path.isdir(path) else "no such directory"
        raise FileNotFoundError(
            f"{path!r} has no {CONFIG}: expected a PEFT adapter directory ({CONFIG} + "
            f"{WEIGHTS}). Found: {found}."
        )
    try:
        with open(file) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a {type(config).__name__}; expected a JSON object.")
    if config.get("peft_type") != "LORA" or config.get("task_type") not in (None, "CAUSAL_LM"):
        raise ValueError(
            f"{file} is a {config.get('peft_type')!r} adapter for {config.get('task_type')!r}; "
            "distrain loads LoRA adapters of causal language models (peft_type 'LORA', "
            "task_type 'CAUSAL_LM')."
        )
    for key, value in sorted(config.items()):
        read = key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout")
        plain = key == "bias" and value == "none"
        if not (read or plain or key == "target_modules" or key in _HARMLESS or not value):
            raise ValueError(
                f"{file}'s {key}={value!r} is not implemented by distrain's LoRA (plain LoRA: "
                "bias 'none', no DoRA, rsLoRA, per-layer ranks, layer selection or other "
                "trained modules). Train or convert the adapter without it."
            )
    return config


def _read_base_hash(path: str) -> str | None:
    """The base hash ``save_adapter`` recorded in the file's metadata (None: PEFT's own)."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, WEIGHTS), framework="np") as f:
        return (f.metadata() or {}).get(BASE_HASH_KEY)


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    file = os.path.join(path, WEIGHTS)
    if not os.path.exists(file):
        raise FileNotFoundError(
            f"{path!r} has no {WEIGHTS} (only safetensors adapters are read; a PEFT "
            "adapter_model.bin is a pickle, which distrain does not load)."
        )
    load = _safetensors().load_file
    try:
        return load(file)
    except Exception as e:  # safetensors' own error type is not public
        raise ValueError(f"{file} is not a readable safetensors file (truncated?): {e}") from None


def load_adapter(path: str, model: nnx.Module, *, check_base: bool = True) -> LoraConfig:
    """Reads a PEFT LoRA adapter onto ``model``, in place, to continue training it or to
    evaluate it; adds the adapters first if the model has none.

    Args:
      path: the adapter's directory (``adapter_config.json`` + ``adapter_model.safetensors``).
      model: a family's module (``dt.models.Llama``, ``Mixtral``, GPT-2's ``Transformer``),
        with the adapters of the same layers, rank and alpha, or without adapters. The
        values keep the layout the model's adapters have.
      check_base: refuse an adapter whose ``distrain_base_sha256`` is not the model's
        :func:`base_sha256` (adapters written by PEFT have none: not checked).

    Returns:
      The adapter's :class:`LoraConfig` (``targets`` names exactly its layers).

    Raises:
      FileNotFoundError: no ``adapter_config.json`` or ``adapter_model.safetensors``.
      ValueError: a field it does not implement (named), an adapter made on another base
        (both named), a tensor for no module of the model, shapes that disagree, or
        adapters on the model that differ (layers, rank or alpha).

    Example:
      >>> lora = dt.models.load_adapter("adapter", module)
    """
    config = _read_config(path)
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise TypeError(
            f"load_adapter needs a model family's module (dt.models.Llama, Mixtral or GPT-2's "
            f"Transformer, with its .cfg) to name its layers; received a {type(model).__name__}."
        )
    family, names = _module_names(cfg)
    where = {hf: p for p, (hf, _) in names.items()}
    tensors = _read_tensors(path)
    values: dict[str, dict[str, np.ndarray]] = {}
    for key, x in sorted(tensors.items()):
        leaf = next((k for k, s in _SUFFIX.items() if key.endswith(s)), None)
        hf = key[len(_PREFIX) : -len(_SUFFIX[leaf])] if leaf and key.startswith(_PREFIX) else ""
        if hf not in where:
            raise ValueError(
                f"{path!r} holds {key!r}, which is no LoRA weight of a module of the "
                f"{family.name} model (those are {_PREFIX}<module>.lora_A.weight / lora_B, "
                f"e.g. modules {sorted(where)[:3]}): an adapter for another model or method."
            )
        values.setdefault(where[hf], {})[leaf] = np.ascontiguousarray(x.T)  # type: ignore[index]
    half = [p for p, v in values.items() if len(v) != 2]
    targeted = set(_targeted(config.get("target_modules") or [], list(where)))
    if half or targeted != {names[p][0] for p in values}:
        raise ValueError(
            f"{path!r}'s tensors do not pair up with its target_modules="
            f"{config.get('target_modules')!r}: lora_A and lora_B of {sorted(targeted)[:4]}... "
            f"expected, found them for {sorted(names[p][0] for p in values)[:4]}...; the "
            "adapter directory is incomplete."
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    lora = LoraConfig(
        rank=r,  # type: ignore[arg-type]  # LoraConfig checks it
        alpha=alpha,  # type: ignore[arg-type]
        dropout=config.get("lora_dropout") or 0.0,
        targets=_pattern(sorted(values), list(linear_paths(model))),
    )
    stored = _read_base_hash(path) if check_base else None
    if stored is not None:
        ours = base_sha256(model)
        if ours != stored:
            raise ValueError(
                f"The adapter in {path!r} was trained on another base model: its "
                f"{BASE_HASH_KEY} is {stored} (base_model_name_or_path="
                f"{config.get('base_model_name_or_path')!r}); the {type(model).__name__} it is "
                f"loaded onto has {ours}. Load that base, or pass check_base=False."
            )
    layers = linear_paths(model)
    adapted = {p for p, m in layers.items() if isinstance(m, LoraLinear)}
    if adapted and adapted != set(values):
        raise ValueError(
            f"The model's adapters ({sorted(adapted)[:3]}...) are not on the layers of the "
            f"adapter in {path!r} ({sorted(values)[:3]}...). Load it onto the base model "
            "without adapters, or add_lora with the adapter's targets."
        )
    _check_shapes(path, values, layers, names, lora)  # before the model changes
    if not adapted:
        model = add_lora(model, lora, rngs=nnx.Rngs(0))  # its values are replaced below
        layers = linear_paths(model)
    for p, pair in values.items():
        for leaf, x in pair.items():
            var = getattr(layers[p], leaf)
            var[...] = _like(x, var[...])
    return lora


def _check_shapes(
    path: str,
    values: dict[str, dict[str, np.ndarray]],
    layers: dict[str, Any],
    names: dict[str, Any],
    lora: LoraConfig,
) -> None:
    """Raises ValueError unless every adapter pair of ``values`` fits its layer of the
    model, and the layer's own adapter (if any) has the same rank and scale."""
    r, alpha = lora.rank, lora.alpha
    for p, pair in sorted(values.items()):
        layer = layers[p]
        d_in, d_out = layer.kernel.shape
        for leaf, want in (("lora_a", (d_in, r)), ("lora_b", (r, d_out))):
            if pair[leaf].shape != want:
                raise ValueError(
                    f"{path!r}'s {names[p][0]}{_SUFFIX[leaf]} is {pair[leaf].T.shape}; the "
                    f"model's {p} (kernel [in, out] {(d_in, d_out)}) with r={r} needs "
                    f"{want[::-1]}. The adapter is for another shape of this model."
                )
        if isinstance(layer, LoraLinear) and (
            layer.lora_a.shape[-1] != r or abs(layer.lora_scale - lora.scale) > 1e-9 * lora.scale
        ):
            raise ValueError(
                f"The model's adapter on {p!r} has rank {layer.lora_a.shape[-1]} and scale "
                f"{layer.lora_scale} (alpha / rank); the adapter in {path!r} has r={r} and scale "
                f"{lora.scale} (lora_alpha={alpha}). add_lora with the adapter's rank and "
                "alpha, or load it onto the base model without adapters."
            )


def _pattern(paths: list[str], layers: list[str]) -> str:
    """A regex that matches exactly ``paths`` among ``layers``: each path with its layer
    numbers generalised (``^(blocks/\\d+/attn/q|...)$``) where that adds no layer, else
    the paths themselves."""
    parts = {"/".join(r"\d+" if k.isdigit() else re.escape(k) for k in p.split("/")) for p in paths}
    general = "^(" + "|".join(sorted(parts)) + ")$"
    if {p for p in layers if re.search(general, p)} == set(paths):
        return general
    return "^(" + "|".join(re.escape(p) for p in paths) + ")$"


def _like(x: np.ndarray, old: Any) -> Any:
    """``x`` in ``old``'s dtype and placement: the sharding of a committed jax array (each
    device given its slice), the default device for an uncommitted one."""
    x = x.astype(old.dtype)
    if isinstance(old, jax.Array) and old.committed:
        return jax.make_array_from_callback(x.shape, old.sharding, lambda index: x[index])
    return jnp.asarray(x) if isinstance(old, jax.Array) else x
