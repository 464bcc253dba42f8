"""``distrain export``: a run's checkpoint to the Hugging Face layout.

The run's config builds its model abstractly (nothing allocated) to learn the family's
config; the newest (or ``--step``) checkpoint of ``--checkpoint`` gives the parameters;
:func:`hub.save_pretrained` writes them. ``--tokenizer bytes`` adds a byte-level
``tokenizer.json`` (token ``i`` is byte ``i``) for the byte vocabularies of the LM
example, so that ``transformers``' pipelines and vLLM read and write text with it.

Example:
  distrain export --config configs/shakespeare_char.yaml --checkpoint runs/ckpt \\
      --to hf exported/ --tokenizer bytes
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

USAGE = "distrain export --config FILE [key=value ...] --checkpoint DIR --to hf OUT"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distrain export",
        usage=USAGE,
        description="Write a run's checkpoint in the Hugging Face layout (config.json + "
        "safetensors) that transformers, vLLM, SGLang, TGI and lm-eval read.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint directory")
    p.add_argument("--step", type=int, default=None, help="the step (default: the newest)")
    p.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "OUT"), help="hf OUT")
    p.add_argument("--dtype", default=None, help="the files' dtype (default: the params')")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="bytes|FILE",
        help="'bytes': a byte-level tokenizer.json (vocab 256); or a tokenizer.json to copy",
    )
    return p


def byte_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` whose token ``i`` is the byte ``i`` (GPT-2's
    byte-to-character table, no merges): text in, bytes out, and back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte a printable character (the printable ones themselves,
    the rest shifted past 255), which byte-level tokenizers use as their alphabet."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    fmt, out = args.to
    if fmt != "hf":
        raise ValueError(f"--to {fmt!r}: the only format is 'hf' (the Hugging Face layout).")
    import jax
    from flax import nnx

    from distrain._src.models import hub
    from distrain._src.models.family import family_of
    from distrain._src.models.run_reader import read_params
    from distrain._src.train.config import load_config
    from distrain._src.train.import_paths import resolve_callable

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the config's import paths, as `distrain train`
    cfg = load_config(args.config, args.overrides)
    model_fn = resolve_callable(cfg.model.fn, "model.fn")
    module = nnx.eval_shape(lambda: model_fn(key=jax.random.key(0), **cfg.model.kwargs))
    family_cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
    if family_cfg is None:
        raise TypeError(
            f"model.fn {cfg.model.fn!r} built a {type(module).__name__} without a family "
            "config (.cfg or .config): export needs a dt.models family's module."
        )
    # What can be checked without reading the checkpoint is checked first.
    family_of(family_cfg).config_to_hf(family_cfg)  # a model without a family: say so
    tokenizer = None
    if args.tokenizer == "bytes":
        if family_cfg.vocab_size != 256:
            raise ValueError(
                f"--tokenizer bytes is for a vocabulary of 256 bytes; the model has "
                f"{family_cfg.vocab_size} tokens. Pass the run's tokenizer.json instead."
            )
        tokenizer = byte_tokenizer()
    elif args.tokenizer is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
    step, params = read_params(args.checkpoint, args.step)
    files = hub.save_pretrained(out, params, family_cfg, dtype=args.dtype, tokenizer=tokenizer)
    print(f"distrain export: step {step} of {args.checkpoint} -> {out} ({len(files)} "
          f"safetensors file{'s' if len(files) > 1 else ''}, config.json)")  # fmt: skip
    return 0
