"""The ``distrain`` command.

Subcommands:

* ``distrain train --config FILE [key=value ...]``: one training run from a YAML
  config (see ``configs/``); overrides use dotted keys, e.g. ``train.epochs=3``.
* ``distrain launch [options] -- PROGRAM ...``: run N processes of a program on this
  machine as one multi-worker job (see ``distrain launch --help``).
* ``distrain goodput WORKDIR [--json F] [--png F]``: where a run's wall time went,
  across restarts (see ``dt.goodput``).
* ``distrain plan --config FILE --devices N [--device-memory 80GiB] [--json]``: will the
  config's step fit on N devices? Compiled from abstract shapes, nothing allocated
  (see ``distrain plan --help``).
* ``distrain evaluate --config FILE [--checkpoint DIR] [--follow] [key=value ...]``: the
  config's eval step on a checkpoint (the newest in DIR, or DIR/<step>), or, with
  ``--follow``, on each checkpoint a training job writes (``dt.SidecarEvaluator``).
  ``distrain train`` does that too in a process whose ``TF_CONFIG`` task (or
  ``DISTRAIN_TASK_TYPE``, set by ``distrain launch --evaluator``) is "evaluator".

Errors: a user error (a bad config, data that cannot be loaded, a bad batch size, an
exception from your own code) is one ``distrain train: error: ...`` line on stderr,
exit status 2 for config errors and for the ValueError/TypeError/OSError a check
raises, 1 for anything else. Ctrl-C is one ``distrain train: interrupted ...`` line
saying what was saved and how to continue (exit status 130); a SIGTERM that
``BackupAndRestore`` saves on exits 143 after one line saying so. ``--debug`` (or
``DISTRAIN_DEBUG=1``) shows the full traceback instead.

Example:
  $ distrain train --config configs/quickstart.yaml train.epochs=5
  $ distrain launch --nproc 2 -- distrain train --config configs/quickstart.yaml \\
        strategy.name=multi_worker_mirrored
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from distrain._src.command_errors import error as _error
from distrain._src.command_errors import run_reporting_errors

_TRAIN_EPILOG = """\
overrides:
  key=value pairs with dotted keys, values parsed as YAML, checked like the file:
    train.epochs=5  optimizer.learning_rate=0.003  model.kwargs.hidden=[64,64]
    strategy.devices=[cpu:0,cpu:1]  logging.dir=runs/exp1  logging.tensorboard=true

config sections: strategy, model, data, optimizer, train, logging, checkpoint, evaluator
  (documented in docs/getting_started.md and dt.config.RunConfig)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distrain",
        description="tf.distribute-style distributed training for JAX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train from a YAML config",
        description="Train a model from a YAML config (see configs/).",
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", required=True, metavar="FILE", help="the YAML run config")
    train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides (dotted keys)"
    )
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the checked config (with overrides and defaults) and exit",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--verbose",
        action="store_true",
        help="let the INFO logs of orbax and MLflow through (also: DISTRAIN_VERBOSE=1)",
    )
    train.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (also: DISTRAIN_DEBUG=1)",
    )
    evaluate = sub.add_parser(
        "evaluate",
        help="evaluate a run's checkpoints (one, or each as it is written: --follow)",
        description="Run the config's eval step on checkpoints (dt.SidecarEvaluator).",
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("--config", required=True, metavar="FILE", help="the YAML run config")
    evaluate.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="the checkpoint directory (default: evaluator.checkpoint_dir, else "
        "checkpoint.dir), or one step's directory DIR/<step>",
    )
    evaluate.add_argument(
        "--follow",
        action="store_true",
        help="evaluate each checkpoint as it is written, until the training's final one",
    )
    evaluate.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides (dotted keys)"
    )
    evaluate.add_argument("--debug", action="store_true", help="show the full traceback")
    # `launch`, `plan` and `goodput` parse their own arguments; listed here for --help.
    sub.add_parser(
        "launch",
        help="run N processes of a program as one multi-worker job",
        add_help=False,
    )
    sub.add_parser(
        "goodput",
        help="where a run's wall time went, across restarts (reads WORKDIR/goodput.jsonl)",
        add_help=False,
    )
    sub.add_parser(
        "export",
        help="write a run's checkpoint in the Hugging Face layout (config.json + safetensors)",
        add_help=False,
    )
    sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness on a run's checkpoint or a Hugging Face directory",
        add_help=False,
    )
    sub.add_parser(
        "plan",
        help="will a config's step fit on N devices? (abstract shapes, nothing allocated)",
        add_help=False,
    )
    return parser


def _debug_wanted(args: argparse.Namespace) -> bool:
    return bool(args.debug) or os.environ.get("DISTRAIN_DEBUG", "").strip() not in ("", "0")


def _train(args: argparse.Namespace) -> int:
    from distrain._src import verbosity
    from distrain._src.cluster.base import is_evaluator_task
    from distrain._src.train.config import config_to_dict, load_config
    from distrain._src.train.config_errors import ConfigError

    debug = _debug_wanted(args)
    if getattr(args, "verbose", False) or verbosity.verbose():
        verbosity.enable()  # the libraries' INFO logs on stderr, here and in child processes
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        if debug:
            raise
        _error(str(e), args.command)
        return 2
    if getattr(args, "print_config", False):
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None), end="")
        return 0
    if args.command == "evaluate" or is_evaluator_task():
        from distrain._src.train.sidecar_run import run_evaluator

        command = args.command  # `train` on an evaluator task says "distrain train: ..."
        follow = args.command == "train" or args.follow
        checkpoint = getattr(args, "checkpoint", None)
        _importable_from_cwd()
        return run_reporting_errors(
            command, lambda: run_evaluator(cfg, checkpoint_dir=checkpoint, follow=follow), debug
        )
    from distrain._src import compile_cache
    from distrain._src.train.run import run_config

    _importable_from_cwd()
    compile_cache.enable()  # a restart reads its programs back (DISTRAIN_COMPILATION_CACHE)

    def train() -> int:
        run_config(cfg, progress_bar=not args.no_progress)
        return 0

    return run_reporting_errors("train", train, debug)


def _importable_from_cwd() -> None:
    # Import paths in the config resolve from the working directory, as with
    # `python -m`: a console script's sys.path starts at its own bin/ directory.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distrain`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        from distrain._src.cluster.launch import main as launch_main

        return launch_main(argv[1:])
    if argv and argv[0] == "goodput":
        from distrain._src.goodput.command import main as goodput_main

        return run_reporting_errors("goodput", lambda: goodput_main(argv[1:]))
    if argv and argv[0] == "export":
        from distrain._src.models.export_command import main as export_main

        return run_reporting_errors("export", lambda: export_main(argv[1:]))
    if argv and argv[0] == "lm-eval":
        from distrain._src.models.lm_eval_command import main as lm_eval_main

        return run_reporting_errors("lm-eval", lambda: lm_eval_main(argv[1:]))
    if argv and argv[0] == "plan":
        from distrain._src.train.plan import main as plan_main

        return run_reporting_errors("plan", lambda: plan_main(argv[1:]))
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return _train(args)


if __name__ == "__main__":
    sys.exit(main())
