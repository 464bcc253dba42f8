"""The evaluator task from a run config: ``distrain train`` on an evaluator, ``distrain
evaluate``.

A process whose ``TF_CONFIG`` task (or ``DISTRAIN_TASK_TYPE``, which ``distrain launch
--evaluator`` sets) is ``evaluator`` runs :func:`run_evaluator` instead of training: it
builds the config's model and state abstractly (nothing is initialised), its eval step
and the ``evaluator.split`` of its data, on this process's own devices (a
``MirroredStrategy``: the evaluator never joins the workers' ``jax.distributed`` world),
and follows ``evaluator.checkpoint_dir`` (default ``checkpoint.dir``) with a
``dt.SidecarEvaluator``. Its logs go to its own directory (``evaluator.workdir``,
default ``logging.dir/evaluator``), never into the training's files.

Example:
  >>> cfg = load_config("configs/quickstart.yaml", ["checkpoint.dir=/tmp/ck"])
  >>> run_evaluator(cfg, follow=False)        # the newest checkpoint, once
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from distrain._src.train.config import RunConfig
from distrain._src.train.config_errors import ConfigError

__all__ = ["run_evaluator"]


def _evaluator_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with a strategy over this process's devices alone."""
    name = cfg.strategy.name
    if name == "diloco":
        raise ConfigError(
            "The evaluator task does not evaluate strategy.name=diloco checkpoints yet (their "
            "state holds each island's copy). Evaluate with a config whose strategy is "
            "mirrored or multi_worker_mirrored, or call Trainer.evaluate on the global model."
        )
    if name in ("multi_worker_mirrored", "tpu"):  # would join (or span) the workers' world
        strategy = cfg.strategy.model_copy(update={"name": "mirrored", "devices": None})
        return cfg.model_copy(update={"strategy": strategy})
    return cfg


def _parts(cfg: RunConfig) -> Any:
    """The evaluator's strategy, abstract state template, eval step and data."""
    from distrain._src.train.data_from_config import load_data, pipelines
    from distrain._src.train.import_paths import resolve_callable
    from distrain._src.train.model_fn import check_call
    from distrain._src.train.plan import abstract_state

    if cfg.train.eval_step is None:
        raise ConfigError(
            "The evaluator task runs train.eval_step, which is not set. Set it to an import "
            "path such as examples.classification:classification_eval_step."
        )
    built = abstract_state(_evaluator_config(cfg))
    bind = dict(apply_fn=built.apply_fn, **cfg.train.step_kwargs)
    eval_fn = resolve_callable(cfg.train.eval_step, "train.eval_step")
    check_call(eval_fn, "train", cfg.train.eval_step, None, None, **bind)
    data_fn = resolve_callable(cfg.data.fn, "data.fn")
    check_call(data_fn, "data", cfg.data.fn, **cfg.data.kwargs)
    splits = pipelines(cfg, load_data(cfg, data_fn), built.strategy.num_replicas_in_sync)
    split = cfg.evaluator.split
    if split not in splits:
        raise ConfigError(
            f"Config field 'evaluator.split' is {split!r}, but {cfg.data.fn} returned the "
            f"splits {sorted(splits)}. Use one of them."
        )
    built.eval_step = functools.partial(eval_fn, **bind)
    built.data = splits[split]
    return built


def _callbacks(cfg: RunConfig, workdir: str) -> list[Any]:
    """The config's loggers, writing into the evaluator's own directory."""
    from distrain._src.train.callbacks.logging import CSVLogger, JSONLinesLogger, TensorBoard
    from distrain._src.train.run import _trackers

    out: list[Any] = []
    if cfg.logging.tensorboard:
        out.append(TensorBoard(workdir))
    if cfg.logging.csv:
        out.append(CSVLogger(os.path.join(workdir, "evaluations.csv")))
    if cfg.logging.jsonl:
        out.append(JSONLinesLogger(os.path.join(workdir, "metrics.jsonl")))
    return out + _trackers(cfg, None)


def run_evaluator(
    cfg: RunConfig,
    *,
    checkpoint_dir: str | None = None,
    follow: bool = True,
    print_fn: Callable[[str], None] = print,
) -> int:
    """Evaluates the checkpoints of ``cfg``'s run; returns the exit status.

    Args:
      cfg: the run config (its ``evaluator`` section says what and how often).
      checkpoint_dir: overrides ``evaluator.checkpoint_dir``; a step directory
        (``DIR/400``) names that one checkpoint.
      follow: follow the directory (a ``SidecarEvaluator`` until the training's final
        checkpoint); ``False`` evaluates one checkpoint (the newest) and prints it.
      print_fn: where the summary lines go.

    Returns:
      0, or ``dt.checkpoint.PREEMPTION_EXIT_CODE`` (143) when SIGTERM stopped it (run
      it again to continue).

    Raises:
      ConfigError: no checkpoint directory in the config or arguments, no
        ``train.eval_step``, a split ``data.fn`` does not return.
    """
    from distrain._src.checkpoint.preemption import PREEMPTION_EXIT_CODE
    from distrain._src.train.sidecar import SidecarEvaluator

    ev = cfg.evaluator
    directory = checkpoint_dir or ev.checkpoint_dir or cfg.checkpoint.dir
    if directory is None:
        raise ConfigError(
            "The evaluator needs the checkpoint directory to follow: set evaluator."
            "checkpoint_dir or checkpoint.dir (the training's ModelCheckpoint directory), "
            "or pass --checkpoint DIR."
        )
    directory = os.path.abspath(directory)
    step = None
    if not follow and os.path.basename(directory).isdigit():  # DIR/400: one step
        directory, step = os.path.dirname(directory), int(os.path.basename(directory))
    workdir = ev.workdir or (
        os.path.join(cfg.logging.dir, "evaluator") if cfg.logging.dir else None
    )
    parts = _parts(cfg)
    print_fn(f"distrain evaluate: {cfg.name} on {parts.strategy!r}, checkpoints in {directory}")
    sidecar = SidecarEvaluator(
        parts.eval_step,
        parts.data,
        directory,
        state=parts.state,
        strategy=parts.strategy,
        steps=ev.steps,
        max_evaluations=ev.max_evaluations,
        callbacks=_callbacks(cfg, workdir) if (follow and workdir) else None,
        every_checkpoint=ev.every_checkpoint,
        timeout=ev.timeout,
        poll_interval=ev.poll_interval,
        workdir=workdir,
    )
    if not follow:
        metrics = sidecar.evaluate(step)
        shown = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        print_fn(f"checkpoint {step if step is not None else 'newest'}: {shown}")
        return 0
    sidecar.start()
    return PREEMPTION_EXIT_CODE if sidecar.stopped_by_signal else 0
