"""Text in and out of token ids for :class:`LMEvalModel`: a small tokenizer interface.

Two kinds: :class:`HFText`, a ``tokenizers.Tokenizer`` (a Hugging Face directory's
``tokenizer.json``: what ``transformers``' fast tokenizers run, so ids and special
tokens are theirs), and :class:`ByteText`, the LM example's vocabulary of 256 (token
``i`` is byte ``i`` of the UTF-8 text; byte 0 separates its documents, so it is the
end of text). :func:`special_tokens` finds the BOS and end-of-text ids of a checkpoint
as ``transformers`` would: ``config.json`` first, then ``tokenizer_config.json``.

Example:
  >>> t = wrap("bytes", vocab_size=256)
  >>> t.encode("hi", True), t.decode([104, 105], True)
  ([104, 105], 'hi')
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ByteText", "HFText", "Text", "special_tokens", "wrap"]


class Text(abc.ABC):
    """What :class:`LMEvalModel` asks of a tokenizer."""

    #: A name for lm-eval's request caches.
    name: str
    #: The end-of-text id when the checkpoint names none (``None``: it must be given).
    default_eot: int | None = None

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of ``text`` (with the tokenizer's BOS/EOS template when asked)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """The text of ``ids``."""

    @abc.abstractmethod
    def pieces(self) -> list[str]:
        """The text of each id alone, in id order (stop strings are looked up in it)."""


class ByteText(Text):
    """Token ``i`` is byte ``i``; no special tokens; byte 0 ends a text."""

    name = "bytes"
    default_eot = 0

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def pieces(self) -> list[str]:
        return [bytes([i]).decode("utf-8", errors="replace") for i in range(256)]


class HFText(Text):
    """A ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.name = f"tokenizers:{tokenizer.get_vocab_size()}"
        # A byte-level tokenizer.json of 256 ids (`distrain export --tokenizer bytes`):
        # the LM example's bytes, whose texts end with byte 0.
        self.default_eot = 0 if tokenizer.get_vocab_size() == 256 else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def pieces(self) -> list[str]:
        n = self.tokenizer.get_vocab_size()
        return list(self.tokenizer.decode_batch([[i] for i in range(n)],
                                                skip_special_tokens=False))  # fmt: skip


def wrap(tokenizer: Any, vocab_size: int) -> Text:
    """``tokenizer`` (``"bytes"``, a ``tokenizers.Tokenizer``, a :class:`Text`, or None:
    bytes for a vocabulary of 256) as a :class:`Text`.

    Raises:
      ValueError: no tokenizer for a vocabulary other than 256; bytes for one.
    """
    if isinstance(tokenizer, Text):
        return tokenizer
    if tokenizer is None and vocab_size == 256:
        tokenizer = "bytes"
    if tokenizer == "bytes":
        if vocab_size != 256:
            raise ValueError(
                f"A byte tokenizer is for a vocabulary of 256; the model has {vocab_size} "
                "tokens. Pass its tokenizers.Tokenizer (or tokenizer.json) instead."
            )
        return ByteText()
    if tokenizer is None:
        raise ValueError(
            f"The model (vocabulary {vocab_size}) comes without a tokenizer: pass "
            "tokenizer= (a tokenizers.Tokenizer, e.g. Tokenizer.from_file('tokenizer.json'))."
        )
    if not all(hasattr(tokenizer, a) for a in ("encode", "decode", "get_vocab_size")):
        raise TypeError(
            "tokenizer must be 'bytes' or a tokenizers.Tokenizer. Received: "
            f"{type(tokenizer).__name__}."
        )
    return HFText(tokenizer)


def special_tokens(hf_config: Mapping[str, Any], directory: str | None,
                   tokenizer: Any) -> tuple[int | None, int | None]:  # fmt: skip
    """``(bos, eot)`` ids: ``config.json``'s ``bos_token_id`` / ``eos_token_id`` (the
    first of a list), else ``tokenizer_config.json``'s ``bos_token`` / ``eos_token``
    looked up in ``tokenizer``."""
    found: list[int | None] = []
    for key in ("bos", "eos"):
        value: Any = hf_config.get(f"{key}_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if value is None and tokenizer is not None and hasattr(tokenizer, "token_to_id"):
            name = _tokenizer_config(directory).get(f"{key}_token")
            name = name.get("content") if isinstance(name, dict) else name
            value = tokenizer.token_to_id(name) if isinstance(name, str) else None
        found.append(None if value is None else int(value))
    return found[0], found[1]


def _tokenizer_config(directory: str | None) -> dict[str, Any]:
    path = os.path.join(directory or "", "tokenizer_config.json")
    if directory is None or not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}
