"""The files of a Hugging Face checkpoint: reading slices of tensors, writing one tensor
at a time.

Reading goes through ``safetensors``' lazy slices: :meth:`Weights.read` reads only the
requested slice of a tensor (what one device holds), never the whole file. Writing is
done here rather than by ``safetensors.numpy.save_file``, which takes every tensor at
once: :func:`write` needs only each tensor's shape and dtype up front (the header), then
asks for the tensors one at a time, so that an export holds one tensor in host memory.
The format is the safetensors specification: an 8-byte little-endian header length, a
JSON header (each tensor's dtype, shape and byte offsets; ``{"format": "pt"}`` metadata,
which ``transformers`` requires), then the raw little-endian bytes.

Example:
  >>> Weights("llama-dir").read("model.embed_tokens.weight", (slice(0, 8), slice(None)))
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

#: safetensors' dtype names and NumPy's (bfloat16 through ml_dtypes, as jax has it).
DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def dtype_name(dtype: Any) -> str:
    """safetensors' name for a NumPy / jax dtype (``"BF16"``).

    Raises:
      ValueError: a dtype safetensors has no name for here.
    """
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(
            f"Cannot write a tensor of dtype {np.dtype(dtype)} to safetensors; expected one "
            f"of {sorted(str(np.dtype(v)) for v in DTYPES.values())}."
        ) from None


def _safe_open() -> Callable[..., Any]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError(
            "Reading Hugging Face checkpoints needs safetensors: pip install 'distrain[hf]'."
        ) from None
    return safe_open


def read_config(directory: str) -> dict[str, Any]:
    """``config.json`` of ``directory``.

    Raises:
      FileNotFoundError: no such directory, or no ``config.json`` in it.
      ValueError: a ``config.json`` that is not a JSON object.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"No checkpoint directory {directory!r}: expected a local directory with "
            "config.json and safetensors files (or a hub name with huggingface_hub installed)."
        )
    path = os.path.join(directory, CONFIG)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{directory!r} has no config.json: expected a Hugging Face checkpoint "
            f"directory (config.json + *.safetensors). Found: {sorted(os.listdir(directory))}."
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a {type(config).__name__}; expected a JSON object.")
    return config


class Weights:
    """The tensors of a checkpoint directory, single-file or sharded (with an index),
    read lazily: a tensor's bytes are read only when a slice of it is.

    Each read opens its file and closes it again: safetensors maps the file into memory,
    and nothing of a file stays mapped between reads, whatever the import's length.

    Raises (on construction):
      FileNotFoundError: no safetensors file (a ``pytorch_model.bin`` is named and
        refused: it is a pickle, which can run code on load), or a file the index names
        that is missing.
      ValueError: a truncated or garbled file (named), or an index that is not one.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._where: dict[str, str] = {}  # tensor -> file
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}  # tensor -> shape, dtype
        self._actual: dict[str, str] = {}  # a name as the family spells it -> the file's
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{index} is not a safetensors index (expected JSON with a weight_map): {e}."
                ) from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(directory, SINGLE)):
            files, weight_map = [SINGLE], None
        else:
            found = sorted(os.listdir(directory))
            pickles = [f for f in found if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
            why = (
                f" It holds {pickles}: PyTorch pickles, which distrain does not load (a "
                "pickle can run code). Convert them to safetensors first (transformers: "
                "save_pretrained(..., safe_serialization=True))."
                if pickles
                else f" Found: {found}."
            )
            raise FileNotFoundError(f"{directory!r} has no {SINGLE} nor {INDEX}.{why}")
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{index} names {name}, which is not in {directory!r}.")
            with self._open(name) as handle:
                for key in handle.keys():
                    part = handle.get_slice(key)
                    self._where[key] = name
                    self._meta[key] = (tuple(part.get_shape()), part.get_dtype())
        if weight_map is not None:
            missing = sorted(k for k, f in weight_map.items() if self._where.get(k) != f)
            if missing:
                raise ValueError(
                    f"{index} maps {len(missing)} tensors to files that do not hold them, "
                    f"e.g. {missing[:3]}: the checkpoint is incomplete or its index is stale."
                )

    def _open(self, name: str) -> Any:
        path = os.path.join(self.directory, name)
        try:
            return _safe_open()(path, framework="np")
        except Exception as e:  # safetensors' own error type is not public
            raise ValueError(
                f"{path} is not a readable safetensors file (truncated or garbled?): {e}"
            ) from None

    def add_prefix(self, prefix: str) -> None:
        """Names tensors with ``prefix`` where no file does (an older naming)."""
        if not prefix or any(k.startswith(prefix) for k in self._where):
            return
        for key in list(self._where):
            self._where[prefix + key] = self._where.pop(key)
            self._meta[prefix + key] = self._meta.pop(key)
            self._actual[prefix + key] = key

    def names(self) -> list[str]:
        return sorted(self._where)

    def _known(self, name: str) -> str:
        if name not in self._where:
            raise KeyError(
                f"{self.directory!r} has no tensor {name!r}, which the model needs: the "
                "checkpoint is incomplete or of another variant of the architecture."
            )
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        self._known(name)
        return self._meta[name][0]

    def dtype(self, name: str) -> Any:
        self._known(name)
        return np.dtype(DTYPES[self._meta[name][1]])

    def read(self, name: str, index: Sequence[slice]) -> np.ndarray:
        """The slice ``index`` (one ``slice`` per axis) of tensor ``name``: only those
        bytes are read.

        Raises:
          KeyError: no such tensor. ValueError: the file's bytes end before the slice.
        """
        file = self._known(name)
        try:
            with self._open(file) as handle:
                # safetensors copies the slice out of the mapping into a buffer of its
                # own, which outlives the file (no second copy here: an import's peak).
                return np.asarray(handle.get_slice(self._actual.get(name, name))[tuple(index)])
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(
                f"Could not read {name!r} from {file} in {self.directory!r} (truncated or "
                f"garbled?): {e}"
            ) from None


#: A tensor to write: its name, shape, dtype, and a function that returns its values
#: (called once, when its turn comes).
Entry = tuple[str, tuple[int, ...], Any, Callable[[], np.ndarray]]


def plan_shards(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Entries grouped into files of at most ``max_shard_bytes`` each (a tensor larger
    than that gets a file of its own), in order."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _nbytes(entry: Entry) -> int:
    return math.prod(entry[1]) * np.dtype(entry[2]).itemsize


def write(
    directory: str, entries: Iterable[Entry], max_shard_bytes: int, write: bool = True
) -> list[str]:
    """Writes ``entries`` as ``model.safetensors`` (or numbered shards and an index once
    they exceed ``max_shard_bytes``), one tensor in memory at a time.

    With ``write=False`` every entry's function is still called in the same order (a
    process that takes part in gathering each tensor but does not write) and nothing is
    written. Returns the files' names.
    """
    entries = list(entries)
    shards = plan_shards(entries, max_shard_bytes)
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards, strict=True):
        write_file(os.path.join(directory, name), shard, write=write)
    if write and len(shards) > 1:
        weight_map = {e[0]: n for n, shard in zip(names, shards, strict=True) for e in shard}
        index = {"metadata": {"total_size": sum(map(_nbytes, entries))}, "weight_map": weight_map}
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump(index, f, indent=2)
    return names


def write_file(
    path: str, entries: Sequence[Entry], metadata: dict[str, str] | None = None, write: bool = True
) -> None:
    """One safetensors file of ``entries`` (in order) with ``metadata`` beside
    ``{"format": "pt"}``; the header's keys in a fixed order, so the same tensors give
    the same bytes (safetensors' own writer orders the metadata as a hash map does)."""
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", **dict(sorted((metadata or {}).items()))}
    }
    offset = 0
    for name, shape, dtype, _ in entries:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
    f = open(path + ".tmp", "wb") if write else None
    try:
        if f is not None:
            f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype, values in entries:
            array = np.ascontiguousarray(values(), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)}, got {array.shape}.")
            if f is not None:
                f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
            del array
    finally:
        if f is not None:
            f.close()
    if write:
        os.replace(path + ".tmp", path)  # a file is either whole or absent
