"""``distrain lm-eval``: lm-evaluation-harness's own command line on a distrain model.

Out-of-tree models cannot be registered from ``lm_eval``'s command line itself, so this
command builds the model first (:class:`LMEvalModel`: from a run's config and checkpoint
on the strategy the config names, or from a Hugging Face directory on
``dt.MirroredStrategy``), so that its errors are one ``distrain lm-eval: error:`` line
before lm-eval starts; registers it under the name ``distrain``; then runs lm-eval's
``cli_evaluate`` with the remaining arguments and ``--model distrain --model_args
built=0`` (the handle of the model built here). Every other flag is lm-eval's own
(``--tasks``, ``--limit``, ``--num_fewshot``, ``--output_path``, ``--batch_size``,
``--include_path``, ``--log_samples``, ...), and its errors (an unknown task) are its
own words. On N processes (``distrain launch``) every process runs the same requests
through the strategy and process 0 alone writes the results: the others run with
``LOCAL_RANK`` set to their process index, which lm-eval reads for that.

Example:
  distrain lm-eval --config configs/lm_tiny.yaml --checkpoint runs/ckpt \\
      --tasks lambada_openai --limit 100 --output_path results/
  distrain lm-eval --pretrained exported/ --tasks hellaswag --batch_size 32
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

USAGE = (
    "distrain lm-eval (--config FILE --checkpoint DIR [--step N] [--override KEY=VALUE] "
    "[--tokenizer bytes|FILE] | --pretrained HF_DIR [--devices-per-replica AXIS=N,...]) "
    "--tasks TASK [lm-eval's flags ...]"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distrain lm-eval",
        usage=USAGE,
        allow_abbrev=False,  # lm-eval's flags pass through whole, never taken for ours
        description="Run lm-evaluation-harness on a distrain model, through its strategy. "
        "Every flag not listed here is lm-eval's own (lm-eval run --help).",
    )
    p.add_argument("--config", metavar="FILE", help="a run's YAML config (with --checkpoint)")
    p.add_argument("--checkpoint", metavar="DIR", help="the run's checkpoint directory")
    p.add_argument("--step", type=int, default=None, help="the step (default: the newest)")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override (dotted key), repeatable",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="bytes|FILE",
        help="'bytes' (default for a vocabulary of 256) or a tokenizer.json",
    )
    p.add_argument("--pretrained", metavar="HF_DIR", help="a Hugging Face checkpoint directory")
    p.add_argument(
        "--devices-per-replica",
        default=None,
        metavar="AXIS=N,...",
        help="with --pretrained: each replica's devices, e.g. fsdp=4",
    )
    return p


def main(argv: Sequence[str]) -> int:
    args, rest = _parser().parse_known_args(list(argv))
    if args.pretrained is None and args.config is None:
        raise ValueError(
            "distrain lm-eval needs a model: --pretrained HF_DIR, or --config FILE with "
            "--checkpoint DIR. Received neither."
        )
    if args.pretrained is not None and args.config is not None:
        raise ValueError("Give --pretrained or --config/--checkpoint, not both.")
    if args.config is not None and args.checkpoint is None:
        raise ValueError(f"--config {args.config} needs --checkpoint DIR (the run's checkpoints).")
    if any(a in ("--model", "-M") or a.startswith("--model=") for a in rest):
        raise ValueError("distrain lm-eval sets lm-eval's --model itself: drop --model.")
    import jax

    from distrain._src.models import lm_eval as adapter

    if args.pretrained is not None:
        from distrain._src.strategy.mirrored import MirroredStrategy

        axes = _axes(args.devices_per_replica)
        strategy = MirroredStrategy(devices_per_replica=axes) if axes else MirroredStrategy()
        lm = adapter.LMEvalModel.from_pretrained(args.pretrained, strategy=strategy)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # the config's import paths, as `distrain train`
        lm = adapter.LMEvalModel.from_checkpoint(
            args.config, args.checkpoint, step=args.step, overrides=args.override,
            tokenizer=args.tokenizer,
        )  # fmt: skip
    adapter._BUILT[0] = lm
    if jax.process_index() != 0:  # lm-eval returns and writes results where it is 0
        os.environ["LOCAL_RANK"] = str(jax.process_index())
    from lm_eval.__main__ import cli_evaluate

    kept = sys.argv
    sys.argv = ["lm-eval", "--model", "distrain", "--model_args", "built=0", *rest]
    try:
        cli_evaluate()
    finally:
        sys.argv = kept
        adapter._BUILT.pop(0, None)
    return 0


def _axes(spec: str | None) -> dict[str, int] | None:
    """``"fsdp=4,tensor=2"`` -> ``{"fsdp": 4, "tensor": 2}``."""
    if spec is None:
        return None
    try:
        return {k.strip(): int(v) for k, v in (p.split("=") for p in spec.split(","))}
    except ValueError:
        raise ValueError(
            f"--devices-per-replica takes AXIS=N pairs joined by commas (fsdp=4,tensor=2). "
            f"Received: {spec!r}."
        ) from None
