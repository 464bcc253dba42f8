"""A model family: how a Hugging Face architecture maps onto a flax NNX module.

A :class:`Family` reads a ``config.json`` into its own config (refusing every field it
does not implement: a silently ignored field is a silently wrong model), builds the
module, and lists, for every parameter leaf of the module, the Hugging Face tensor(s) it
is stored as (:class:`Tensor`). Import (``hub.py``) and export read that list only, so a
family holds no file code and the files hold no model code.

Example:
  >>> family = family_for({"model_type": "llama", ...})
  >>> cfg = family.config_from_hf(hf_config)
  >>> module = family.build(cfg, nnx.Rngs(0))
  >>> family.tensors(cfg)[0]
  Tensor(path='embed/embedding', names=('model.embed_tokens.weight',), transpose=False)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from flax import nnx

#: ``config.json`` keys that never change what a model computes (ids, bookkeeping,
#: generation defaults, the file's dtype: import reads the tensors' own dtypes).
HARMLESS_KEYS = frozenset(
    {
        "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
        "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
        "initializer_range", "output_attentions", "output_hidden_states", "return_dict",
        "tokenizer_class", "id2label", "label2id", "task_specific_params",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Tensor:
    """How one parameter leaf is stored in a Hugging Face checkpoint.

    Attributes:
      path: the leaf's path in the module's parameters, keys joined by ``/``
        (``"blocks/0/attn/qkv/kernel"``: ``dt.pytree.path_str``'s spelling).
      names: its tensor name in the files; several names: the leaf stacks them along its
        first axis (a mixture's experts, or stacked layers), in order.
      transpose: the file holds each tensor with its two axes swapped (PyTorch's
        ``Linear.weight`` is ``[out, in]``; an NNX kernel ``[in, out]``).
    """

    path: str
    names: tuple[str, ...]
    transpose: bool = False


class Family(abc.ABC):
    """One Hugging Face architecture (or a few that share a module, e.g. Llama and
    Mistral). Subclasses are final: they fill the abstract methods only."""

    #: distrain's name for it (``"llama"``).
    name: ClassVar[str]
    #: The ``model_type`` values of ``config.json`` it reads.
    model_types: ClassVar[tuple[str, ...]]
    #: Regexes of tensors in the files that are buffers, not weights (skipped on import).
    ignored: ClassVar[tuple[str, ...]] = ()
    #: A prefix of the tensor names (``tensors``) that some checkpoints omit (GPT-2's
    #: first ones write ``h.0...`` where transformers writes ``transformer.h.0...``).
    prefix: ClassVar[str] = ""

    @abc.abstractmethod
    def config_from_hf(self, hf: Mapping[str, Any]) -> Any:
        """The family's config for ``config.json``'s contents.

        Raises:
          ValueError: a field it does not implement (named, with its value).
        """

    @abc.abstractmethod
    def config_to_hf(self, cfg: Any) -> dict[str, Any]:
        """``config.json``'s contents for ``cfg`` (``architectures`` and ``model_type``
        included; the dtype is the exporter's)."""

    @abc.abstractmethod
    def build(self, cfg: Any, rngs: nnx.Rngs) -> nnx.Module:
        """The module for ``cfg`` (its parameters' values are replaced on import)."""

    @abc.abstractmethod
    def tensors(self, cfg: Any) -> list[Tensor]:
        """Every parameter leaf of ``build(cfg)`` and its tensors, in the files' order."""

    def owns(self, cfg: Any) -> bool:
        """Whether ``cfg`` is this family's config (export finds the family by it)."""
        return False


def check_keys(family: str, hf: Mapping[str, Any], implemented: Iterable[str]) -> None:
    """Refuses keys of ``hf`` that are neither ``implemented`` (read and checked by the
    family) nor :data:`HARMLESS_KEYS`.

    Raises:
      ValueError: naming the keys and their values.
    """
    unknown = sorted(set(hf) - set(implemented) - HARMLESS_KEYS)
    if unknown:
        shown = ", ".join(f"{k}={hf[k]!r}" for k in unknown)
        raise ValueError(
            f"config.json has fields distrain's {family} family does not implement: {shown}. "
            "A field it ignored would give a silently different model: remove them if "
            "they are defaults of your transformers version, or use another family."
        )


def refuse(family: str, key: str, value: Any, expected: str) -> ValueError:
    """The error for a field whose value the family does not implement."""
    return ValueError(
        f"config.json's {key}={value!r} is not implemented by distrain's {family} family "
        f"(it implements {expected})."
    )


_FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Adds ``family`` to those :func:`family_for` and :func:`family_of` search."""
    _FAMILIES.append(family)
    return family


def families() -> list[Family]:
    """The registered families (``[f.name for f in dt.models.families()]``: ``["gpt2",
    "llama", "mixtral"]``)."""
    return list(_FAMILIES)


def family_for(hf: Mapping[str, Any]) -> Family:
    """The family whose ``model_types`` hold ``config.json``'s ``model_type``.

    Raises:
      ValueError: an unsupported (or missing) ``model_type``, listing the supported ones;
        a config that needs ``trust_remote_code`` (``auto_map``).
    """
    if "auto_map" in hf:
        raise ValueError(
            "config.json has auto_map: the model needs trust_remote_code (code from the "
            "checkpoint's author), which distrain never runs. Use a supported architecture: "
            f"{supported()}."
        )
    model_type = hf.get("model_type")
    for family in _FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(
        f"config.json's model_type={model_type!r} (architectures "
        f"{hf.get('architectures')}) is not supported; distrain reads {supported()}."
    )


def family_of(cfg: Any) -> Family:
    """The family that owns the config object ``cfg`` (for export).

    Raises:
      TypeError: no family owns it.
    """
    for family in _FAMILIES:
        if family.owns(cfg):
            return family
    raise TypeError(
        f"No model family exports a {type(cfg).__name__}; expected the config of one of "
        f"{supported()} (dt.models.LMConfig, dt.models.LlamaConfig, ...)."
    )


def supported() -> str:
    return ", ".join(sorted(t for f in _FAMILIES for t in f.model_types))
