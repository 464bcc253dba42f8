"""Hugging Face checkpoints in and out: :func:`from_pretrained` and :func:`save_pretrained`.

Import reads ``config.json`` into a family's config (``family.py``), builds the module
abstractly (nothing allocated), asks the strategy where each parameter lives, and fills
each device's shard with ``jax.make_array_from_callback``: every process reads only the
slices its own devices hold, straight from the files (``safetensors_io.py``), so no host
ever holds the whole model. Export gathers one parameter at a time, writes it in the
file's dtype and tensor names, and drops it before the next.

Example:
  >>> strategy = dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2})
  >>> model = dt.models.from_pretrained("path/to/llama", strategy=strategy)
  >>> state = dt.TrainState.create(apply_fn=model.apply_fn, params=model.params, tx=tx)
  >>> dt.models.save_pretrained("out", state, model)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from distrain._src import pytree
from distrain._src.models import family as _family
from distrain._src.models import safetensors_io as io

#: Tokenizer files carried from an imported checkpoint to its export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
#: Default largest safetensors file of an export (transformers' default is 5 GB too).
MAX_SHARD_BYTES = 5 * 10**9


@dataclasses.dataclass
class Pretrained:
    """A model read from a Hugging Face checkpoint.

    Attributes:
      family: its :class:`Family` (``.name``: ``"llama"``, ...).
      config: the family's config (``LMConfig``, ``LlamaConfig``, ...).
      graphdef: the NNX graph; ``nnx.merge(graphdef, params)`` is the module.
      params: the parameters (an ``nnx.State``), laid out by the strategy.
      hf_config: ``config.json`` as read.
      dtypes: each tensor's dtype in the files, which export writes by default.
      tokenizer: a ``tokenizers.Tokenizer`` from ``tokenizer.json``, or None.
      directory: where it was read from (export copies its tokenizer files).
    """

    family: _family.Family
    config: Any
    graphdef: Any
    params: Any
    hf_config: dict[str, Any]
    dtypes: dict[str, Any]
    tokenizer: Any = None
    directory: str | None = None

    @property
    def module(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params)

    @property
    def apply_fn(self) -> Callable[..., Any]:
        """``apply_fn(params, tokens, ...) -> logits`` for a ``dt.TrainState``."""
        graphdef = self.graphdef

        def apply_fn(params: Any, *args: Any, **kwargs: Any) -> Any:
            return nnx.merge(graphdef, params)(*args, **kwargs)

        return apply_fn


def _leaf_path(path: Any) -> str:
    """A parameter's path as ``Tensor.path`` spells it (flax may add ``/value``)."""
    s = pytree.path_str(path)
    return s[: -len("/value")] if s.endswith("/value") else s


def _resolve(path: str, revision: str | None) -> str:
    """A local directory for ``path``: itself, or a hub name's snapshot (the local
    cache first; offline (``HF_HUB_OFFLINE=1``) only the cache)."""
    if os.path.isdir(path) or os.path.isabs(path) or path.startswith("."):
        return path
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path):
        raise FileNotFoundError(
            f"No checkpoint directory {path!r}, and it is not a hub name (owner/name)."
        )
    try:
        import huggingface_hub
    except ImportError:
        raise FileNotFoundError(
            f"No local directory {path!r}; to read it as a hub name install huggingface_hub "
            "(pip install 'distrain[hf]')."
        ) from None
    patterns = [io.CONFIG, "*.safetensors", io.INDEX, *TOKENIZER_FILES]
    try:
        return huggingface_hub.snapshot_download(path, revision=revision, allow_patterns=patterns)
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        why = (
            "HF_HUB_OFFLINE is set and it is not in the local cache"
            if offline
            else f"{type(e).__name__}: {e}"
        )
        raise FileNotFoundError(
            f"Could not get {path!r} from the Hugging Face hub ({why}). Download it where "
            "there is a network (huggingface-cli download), or pass a local directory."
        ) from None


def from_pretrained(
    path: str,
    *,
    strategy: Any = None,
    dtype: Any = None,
    revision: str | None = None,
) -> Pretrained:
    """Reads a Hugging Face checkpoint (``config.json`` + safetensors) into the layout
    ``strategy`` gives its state.

    Args:
      path: a local directory, or a hub name (``"owner/name"``) when huggingface_hub is
        installed (offline: from its cache).
      strategy: where the parameters live (default: the current strategy,
        ``dt.get_strategy()``). Each process reads only its devices' slices.
      dtype: the parameters' dtype (default: each tensor's dtype in the files).
      revision: a hub revision (branch, tag or commit).

    Returns:
      A :class:`Pretrained`.

    Raises:
      FileNotFoundError: no such directory or hub name, no ``config.json``, or only
        PyTorch pickles.
      ValueError: an unsupported architecture or config field, a missing or unexpected
        tensor, a shape that differs from the config's, or a garbled file.
    """
    from distrain._src.current import get_strategy

    strategy = strategy if strategy is not None else get_strategy()
    directory = _resolve(path, revision)
    hf = io.read_config(directory)
    family = _family.family_for(hf)
    cfg = family.config_from_hf(hf)
    abstract = nnx.eval_shape(lambda: family.build(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    tensors = {t.path: t for t in family.tensors(cfg)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    paths = [_leaf_path(p) for p, _ in flat]
    _check_covered(family.name, paths, tensors)
    # With a "params/" prefix: the paths the layout rules see in a dt.TrainState.
    shardings = jax.tree.leaves(strategy.state_shardings({"params": state}))
    weights = io.Weights(directory)
    weights.add_prefix(family.prefix)
    _check_used(directory, weights, family, tensors)
    dtypes = {n: weights.dtype(n) for t in tensors.values() for n in t.names}
    leaves = []
    for path, (_, leaf), sharding in zip(paths, flat, shardings, strict=True):
        t = tensors[path]
        _check_shape(weights, t, tuple(leaf.shape))
        want = np.dtype(dtype) if dtype is not None else weights.dtype(t.names[0])
        leaves.append(_place(tuple(leaf.shape), sharding, weights, t, want))
    tokenizer = _tokenizer(directory)
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    return Pretrained(family, cfg, graphdef, params, hf, dtypes, tokenizer, directory)


#: Rows of a shard read at a time, at most this many bytes: an import's host memory is
#: the parameters plus one such chunk.
CHUNK_BYTES = 64 * 2**20
#: XLA:CPU uses a host buffer as device memory (no copy) when it is aligned to this.
_ALIGN = 64


def _place(
    shape: tuple[int, ...], sharding: Any, weights: io.Weights, t: _family.Tensor, dtype: Any
) -> jax.Array:
    """The leaf ``t`` laid out by ``sharding``: each addressable device's shard read from
    the files into an aligned host buffer, a chunk of rows at a time, and handed to the
    device with ``may_alias=True``. On CPU the device keeps that buffer (no second copy);
    elsewhere it is copied to the device and freed. (``jax.make_array_from_callback``
    copies every shard once more on CPU: 1.33x the parameters' bytes at the peak of a 1 GB
    import instead of 1.08x, ``benchmarks/results/hf_import.json``.)"""
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = [range(n)[i] for n, i in zip(shape, index, strict=True)]
        host = _aligned(tuple(len(r) for r in bounds), dtype)
        if host.ndim == 0:
            host[...] = read_slice(weights, t, ())
        else:
            step = max(1, CHUNK_BYTES // max(1, host[:1].nbytes))
            for k in range(0, len(bounds[0]), step):
                rows = bounds[0][k : k + step]
                sub = (slice(rows.start, rows.stop), *index[1:])
                host[k : k + len(rows)] = read_slice(weights, t, sub)
        arrays.append(jax.device_put(host, device, may_alias=True))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _aligned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on an ``_ALIGN``-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + n].view(dtype).reshape(shape)


def read_slice(weights: io.Weights, t: _family.Tensor, index: tuple[slice, ...]) -> np.ndarray:
    """The part ``index`` of the leaf ``t`` describes, from its tensor(s) in the files."""
    if len(t.names) == 1:
        return _read_one(weights, t.names[0], index, t.transpose)
    first = range(len(t.names))[index[0]]
    return np.stack([_read_one(weights, t.names[i], index[1:], t.transpose) for i in first])


def _read_one(weights: io.Weights, name: str, index: tuple[slice, ...], transpose: bool) -> Any:
    if not transpose:
        return weights.read(name, index)
    return weights.read(name, index[::-1]).T


def _file_shape(weights: io.Weights, t: _family.Tensor) -> tuple[int, ...]:
    shapes = {weights.shape(n) for n in t.names}
    if len(shapes) > 1:
        raise ValueError(f"The tensors {t.names} stacked into {t.path} differ in shape: {shapes}.")
    shape = shapes.pop()
    shape = shape[::-1] if t.transpose else shape
    return (len(t.names), *shape) if len(t.names) > 1 else shape


def _check_shape(weights: io.Weights, t: _family.Tensor, expected: tuple[int, ...]) -> None:
    got = _file_shape(weights, t)
    if got != expected:
        raise ValueError(
            f"Tensor {t.names[0]!r} (for {t.path}) has shape {got} in the files; config.json "
            f"gives {expected}. The config and the weights disagree: check the checkpoint."
        )


def _check_covered(family: str, paths: list[str], tensors: Mapping[str, Any]) -> None:
    missing, extra = sorted(set(paths) - set(tensors)), sorted(set(tensors) - set(paths))
    if missing or extra:  # a defect of the family, not of the user's files
        raise AssertionError(f"{family}: leaves without a tensor {missing}; unknown {extra}.")


def _check_used(
    directory: str, weights: io.Weights, family: _family.Family, tensors: Mapping[str, Any]
) -> None:
    wanted = {n for t in tensors.values() for n in t.names}
    missing = sorted(wanted - set(weights.names()))
    if missing:
        raise ValueError(
            f"{directory!r} lacks {len(missing)} tensors the {family.name} model of its "
            f"config.json needs, e.g. {missing[:3]}: the checkpoint is incomplete or of "
            "another variant."
        )
    ignored = [re.compile(p) for p in family.ignored]
    unused = [
        n for n in weights.names() if n not in wanted and not any(p.search(n) for p in ignored)
    ]
    if unused:
        raise ValueError(
            f"{directory!r} holds {len(unused)} tensors distrain's {family.name} model has no "
            f"place for, e.g. {sorted(unused)[:3]}: a variant of the architecture it does not "
            "implement (a model loaded without them would be wrong)."
        )


def _tokenizer(directory: str) -> Any:
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None  # the weights do not need it; Pretrained.tokenizer says None
    return Tokenizer.from_file(path)


def save_pretrained(
    path: str,
    params_or_state: Any,
    model: Pretrained | Any,
    *,
    dtype: Any = None,
    tokenizer: Any = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Writes parameters in the Hugging Face layout of their family: ``config.json``
    and safetensors (sharded, with an index, above ``max_shard_bytes``).

    Every process must call it (each parameter is gathered from all of them, one at a
    time); process 0 writes.

    Args:
      path: the directory to write (created).
      params_or_state: the parameters (an ``nnx.State`` or its pure dict), or a
        ``dt.TrainState`` holding them in ``params``; in any layout.
      model: the :class:`Pretrained` it came from (its files' dtypes and tokenizer are
        the defaults), or a family's config (``dt.models.LMConfig``, ...).
      dtype: the files' dtype (default: the imported files' per tensor, else float32).
      tokenizer: a ``tokenizers.Tokenizer`` to write as ``tokenizer.json`` (default:
        the imported checkpoint's tokenizer files, copied).
      max_shard_bytes: the largest file.

    Returns:
      The safetensors files' names.

    Raises:
      TypeError: a config no family exports. ValueError: parameters whose structure is
        not the config's model.
    """
    pretrained = model if isinstance(model, Pretrained) else None
    cfg = pretrained.config if pretrained is not None else model
    family = pretrained.family if pretrained is not None else _family.family_of(cfg)
    hf = family.config_to_hf(cfg)  # first: it says why a config cannot be exported
    params = getattr(params_or_state, "params", params_or_state)
    flat = {_leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    tensors = family.tensors(cfg)
    paths = {t.path for t in tensors}
    missing, unexpected = sorted(paths - set(flat)), sorted(set(flat) - paths)
    if missing or unexpected:
        raise ValueError(
            f"The parameters are not those of the {family.name} model of this config: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}."
        )
    writer = jax.process_index() == 0

    def file_dtype(name: str, leaf: Any) -> Any:
        if dtype is not None:
            return np.dtype(dtype)
        if pretrained is not None and name in pretrained.dtypes:
            return np.dtype(pretrained.dtypes[name])
        return np.dtype(leaf.dtype)

    entries: list[io.Entry] = []
    for t in tensors:
        leaf = flat[t.path]
        gathered = _Gathered(leaf)
        per_name = tuple(leaf.shape[1:]) if len(t.names) > 1 else tuple(leaf.shape)
        shape = per_name[::-1] if t.transpose else per_name
        for i, name in enumerate(t.names):
            pick = i if len(t.names) > 1 else None
            entries.append((name, shape, file_dtype(name, leaf), gathered.part(pick, t.transpose)))
    # The special tokens of the imported checkpoint; none otherwise (transformers would
    # fill in its own family's, e.g. GPT-2's 50256, outside a byte vocabulary).
    source = pretrained.hf_config if pretrained is not None else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        hf.setdefault(key, source.get(key))
    dtypes = {np.dtype(e[2]).name for e in entries}
    hf["torch_dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    if writer:
        os.makedirs(path, exist_ok=True)
    files = io.write(path, entries, max_shard_bytes, write=writer)
    if writer:
        with open(os.path.join(path, io.CONFIG), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
        _write_tokenizer(path, tokenizer, pretrained)
    multihost_utils.sync_global_devices("distrain.models.save_pretrained")
    return files


class _Gathered:
    """One parameter, gathered whole on the host when its first tensor is written and
    dropped after its last (one parameter in host memory at a time)."""

    def __init__(self, leaf: Any) -> None:
        self.leaf, self.left = leaf, 0
        self.value: np.ndarray | None = None

    def part(self, index: int | None, transpose: bool) -> Callable[[], np.ndarray]:
        self.left += 1

        def values() -> np.ndarray:
            whole = self.value if self.value is not None else _host(self.leaf)
            self.value = whole
            x = whole if index is None else whole[index]
            self.left -= 1
            if not self.left:
                self.value = None
            return x.T if transpose else x

        return values


def _host(x: Any) -> np.ndarray:
    """``x`` whole, as NumPy, on every process (a collective when it spans processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _write_tokenizer(path: str, tokenizer: Any, pretrained: Pretrained | None) -> None:
    if tokenizer is not None:
        tokenizer.save(os.path.join(path, "tokenizer.json"))
        return
    source = pretrained.directory if pretrained is not None else None
    if source is None:
        return
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
