"""Build and run a training run from a run config (``dt.config.RunConfig``).

This is what ``distrain train --config FILE`` does: make the strategy, the model and
its ``TrainState``, the data pipelines, the steps and the callbacks the config names;
``fit``; then evaluate on the test split and report. The run is done only then: its
backups (``checkpoint.backup_dir``) keep the finished state until the final evaluation
is, so a rerun after a kill there only evaluates, and its goodput ledger counts that
kill as a failure.

What a config's sections become is built beside it: ``strategy_from_config.py`` builds
the strategy, ``data_from_config.py`` the data, ``import_paths.py`` imports the functions
a config names; this module makes the model, state, steps and callbacks, and runs them.

Example:
  >>> from distrain.config import load_config
  >>> result = run_config(load_config("configs/quickstart.yaml", ["train.epochs=1"]))
  >>> result.test_metrics["accuracy"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from distrain._src.goodput.ledger import milestone
from distrain._src.train.config import RunConfig, config_to_dict
from distrain._src.train.config_errors import ConfigError
from distrain._src.train.data_from_config import load_data, pipelines
from distrain._src.train.import_paths import resolve_callable
from distrain._src.train.model_fn import check_call as _check_call
from distrain._src.train.model_fn import split_model as _split_model
from distrain._src.train.strategy_from_config import build_strategy

__all__ = ["RunInterrupted", "RunResult", "run_config"]


@dataclasses.dataclass
class RunResult:
    """What a run produced: the final state, the history, test metrics and wall time."""

    state: Any
    history: Any
    test_metrics: dict[str, float] | None
    seconds: float


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped ``run_config``'s ``fit``; the message says what was saved and how to
    continue (what ``distrain train`` prints instead of a traceback)."""


def _interrupted(trainer: Any, evaluating: bool = False) -> str:
    """What Ctrl-C leaves: where it stopped, what can be resumed and how."""
    from distrain._src.train.callbacks.checkpointing import BackupAndRestore, ModelCheckpoint

    step = trainer.loop.global_step
    where = f"interrupted at step {step}"
    if evaluating:
        where = f"interrupted in the final evaluation (training had finished at step {step})"
    backup = next((cb for cb in trainer.callbacks if isinstance(cb, BackupAndRestore)), None)
    if backup is None:
        again = "retrains from step 0" if evaluating else "starts over"
        keep = next((cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)), None)
        if keep is None or keep.last_saved_step is None:
            saved = "" if keep is None else ", and no checkpoint in checkpoint.dir yet"
            return (
                f"{where}; nothing was saved (no checkpoint.backup_dir{saved}), so running "
                f"the command again {again}"
            )
        # ModelCheckpoint keeps checkpoints for later use; the command resumes from backups.
        return (
            f"{where}; running the command again {again}: it resumes only from "
            "checkpoint.backup_dir, which is not set. checkpoint.dir keeps the checkpoint "
            f"of step {keep.last_saved_step} in {keep.directory} (for later use: "
            "dt.checkpoint.CheckpointManager(dir).restore(target=state)); set "
            "checkpoint.backup_dir to make a run resumable"
        )
    if backup.newest_backup is None:
        return (
            f"{where}, before the first backup in {backup.directory}; running the same "
            "command again starts over"
        )
    if evaluating:
        return (
            f"{where}; its final state is backed up (step {backup.newest_backup} in "
            f"{backup.directory}): run the same command to evaluate without training again"
        )
    return (
        f"{where}; the newest backup is step {backup.newest_backup} in {backup.directory}: "
        "run the same command to continue from it"
    )


def _callbacks(cfg: RunConfig, progress_bar: bool) -> list[Any]:
    from distrain._src.train.callbacks import checkpointing, goodput, logging

    out: list[Any] = []
    if cfg.logging.progress_bar and progress_bar:
        out.append(logging.ProgressBar())
    log_dir = cfg.logging.dir
    wants_files = cfg.logging.tensorboard or cfg.logging.csv or cfg.logging.jsonl
    if wants_files:
        if log_dir is None:
            raise ConfigError(
                "logging.tensorboard/csv/jsonl need a directory: set logging.dir (e.g. runs/NAME)."
            )
        if cfg.logging.tensorboard:
            out.append(logging.TensorBoard(log_dir))
        if cfg.logging.csv:
            out.append(logging.CSVLogger(os.path.join(log_dir, "epochs.csv")))
        if cfg.logging.jsonl:
            out.append(logging.JSONLinesLogger(os.path.join(log_dir, "metrics.jsonl")))
    if log_dir is not None and cfg.logging.goodput and cfg.fault_isolation is None:
        # The run is finished once its final evaluation is: run_config says when. (Islands
        # keep a ledger of their own, in fault_isolation.directory/island-I.)
        out.append(
            goodput.Goodput(log_dir, interval=cfg.logging.goodput_interval, finish_with_fit=False)
        )
    ck = cfg.checkpoint
    if ck.backup_dir is not None:
        out.append(
            checkpointing.BackupAndRestore(
                ck.backup_dir,
                save_freq=ck.backup_freq,
                # The finished state stays backed up until the final evaluation is done
                # (run_config deletes the backups then): a kill in it does not retrain.
                delete_checkpoint=False,
                local_directory=ck.local_dir,
                local_save_freq=ck.local_freq,
            )
        )
    keep = None
    if ck.dir is not None:
        keep = checkpointing.ModelCheckpoint(
            ck.dir, save_freq=ck.save_freq, max_to_keep=ck.max_to_keep
        )
        out.append(keep)
    out += _trackers(cfg, keep)
    return out


def _trackers(cfg: RunConfig, keep: Any) -> list[Any]:
    """The W&B / MLflow loggers of ``logging.wandb`` / ``logging.mlflow``."""
    from distrain._src.train.callbacks.tracking import MLflowLogger, WandbLogger

    out: list[Any] = []
    wb, mf = cfg.logging.wandb, cfg.logging.mlflow
    for section, wants in (("wandb", wb), ("mlflow", mf)):
        if wants is not None and wants.log_checkpoint and keep is None:
            raise ConfigError(
                f"logging.{section}.log_checkpoint uploads the newest checkpoint of "
                "checkpoint.dir, which is not set. Set checkpoint.dir (e.g. checkpoints/NAME) "
                f"or logging.{section}.log_checkpoint=false."
            )
    if wb is None and mf is None:
        return out
    config = config_to_dict(cfg)  # the file after overrides: what this run is
    if wb is not None:
        out.append(
            WandbLogger(
                wb.project,
                name=cfg.name,
                config=config,
                entity=wb.entity,
                group=wb.group,
                tags=wb.tags,
                mode=wb.mode,
                dir=wb.dir,
                log_checkpoint=keep if wb.log_checkpoint else None,
            )
        )
    if mf is not None:
        out.append(
            MLflowLogger(
                mf.experiment,
                run_name=cfg.name,
                config=config,
                tracking_uri=mf.tracking_uri,
                tags=mf.tags,
                log_checkpoint=keep if mf.log_checkpoint else None,
            )
        )
    return out


def _init_model(
    model_fn: Callable[..., Any], key: jax.Array, **kwargs: Any
) -> tuple[Callable[..., jax.Array], Any]:
    """``_split_model(model_fn(key=key, **kwargs))``, initialised in one compiled call.

    Building a model eagerly compiles every initializer separately (dozens of small
    XLA programs); tracing the whole construction once is much faster to start.
    """
    found: dict[str, Any] = {}

    def init(k: jax.Array) -> Any:
        found["apply_fn"], params = _split_model(model_fn(key=k, **kwargs))
        return params

    params = jax.jit(init)(key)
    return found["apply_fn"], params


def run_config(
    cfg: RunConfig,
    *,
    callbacks: Sequence[Any] = (),
    progress_bar: bool = True,
    print_fn: Callable[[str], None] | None = print,
) -> RunResult:
    """Trains as ``cfg`` says, then evaluates on the ``test`` split (if any).

    With ``checkpoint.backup_dir`` the backups, the finished state included, are deleted
    after that evaluation (``checkpoint.delete_backups``); a run that resumes from a
    finished state trains nothing and only evaluates.

    Args:
      cfg: the run config.
      callbacks: extra callbacks (after the configured ones).
      progress_bar: allow the config's progress bar (tests turn it off).
      print_fn: where the summary lines go (``None``: silent). Only the chief prints.

    Raises:
      ConfigError: a name in the config that cannot be imported or used, a batch size
        that does not divide over the replicas, data that cannot be loaded (MNIST
        offline).
      RunInterrupted: Ctrl-C, in ``fit`` or the final evaluation; its message says what
        can be resumed and how.
    """
    from distrain._src.train.callbacks.checkpointing import BackupAndRestore
    from distrain._src.train.callbacks.goodput import Goodput
    from distrain._src.train.optimizer import LearningRateLogger
    from distrain._src.train.trainer import Trainer

    start = time.perf_counter()
    strategy = build_strategy(cfg.strategy)
    islands = None
    if cfg.fault_isolation is not None:
        islands = cfg.fault_isolation.build(cfg.seed if cfg.data.shuffle else None)
        cfg = _island_directories(cfg, islands.ids()[0])
    chief = strategy.is_chief
    say = print_fn if (print_fn is not None and chief) else (lambda _msg: None)
    say(f"distrain train: {cfg.name} on {strategy!r} ({jax.devices()[0].platform})")
    apply_fn, state, schedule = _model_and_state(cfg, strategy, say)
    data = _data(cfg, strategy.num_replicas_in_sync)
    train_step, eval_step = _steps(cfg, apply_fn)

    val_name = cfg.data.validation_split
    if val_name is not None and val_name not in data:
        raise ConfigError(
            f"Config field 'data.validation_split' is {val_name!r}, but {cfg.data.fn} returned "
            f"the splits {sorted(data)}. Use one of them or null."
        )
    configured = _callbacks(cfg, progress_bar)
    trainer = Trainer(
        strategy,
        train_step,
        eval_step,
        # The schedule's value joins the logs before the loggers write them.
        callbacks=[
            *([LearningRateLogger(schedule)] if schedule is not None else []),
            *configured,
            *callbacks,
        ],
        steps_per_execution=cfg.train.steps_per_execution,
        log_every=cfg.train.log_every,
        grad_accum_steps=cfg.train.grad_accum_steps,
        islands=islands,
    )
    try:
        state, history = trainer.fit(
            state,
            data["train"],
            epochs=cfg.train.epochs,
            steps=cfg.train.steps,
            validation_data=data[val_name] if (val_name and eval_step) else None,
            validation_freq=cfg.train.validation_freq,
        )
    except KeyboardInterrupt:
        raise RunInterrupted(_interrupted(trainer)) from None
    # The run is done when this is: until then the finished state stays backed up and
    # the ledger unfinished, so a kill here is a failure that a rerun only evaluates after.
    ledger = next((c.ledger for c in configured if isinstance(c, Goodput)), None)
    test_metrics = None
    if eval_step is not None and "test" in data:
        test_metrics = _final_evaluation(trainer, state, data["test"], ledger, say)
    backup = next((c for c in configured if isinstance(c, BackupAndRestore)), None)
    if backup is not None and cfg.checkpoint.delete_backups:
        backup.delete_backups()
    if ledger is not None:
        ledger.finished()
    seconds = time.perf_counter() - start
    loop = trainer.loop
    ran = f"{loop.global_step - loop.initial_step} steps"
    if loop.initial_step:
        ran += f", resumed at step {loop.initial_step}, now at {loop.global_step}"
    say(f"time: {seconds:.1f} s ({ran})")
    return RunResult(state, history, test_metrics, seconds)


def _island_directories(cfg: RunConfig, island: int) -> RunConfig:
    """``cfg`` with each of its logging and checkpoint directories in an ``island-I``
    subdirectory: every island writes its own logs, backups and checkpoints."""

    def own(path: str | None) -> str | None:
        return None if path is None else os.path.join(path, f"island-{island}")

    ck, lg = cfg.checkpoint, cfg.logging
    checkpoint = ck.model_copy(
        update={k: own(getattr(ck, k)) for k in ("dir", "backup_dir", "local_dir")}
    )
    logging = lg.model_copy(update={"dir": own(lg.dir)})
    return cfg.model_copy(update={"checkpoint": checkpoint, "logging": logging})


def _model_and_state(
    cfg: RunConfig, strategy: Any, say: Callable[[str], None]
) -> tuple[Callable[..., Any], Any, Any]:
    """``(apply_fn, state, schedule)``: the model ``model`` names (or the pretrained one)
    and its ``TrainState`` with the optimizer of ``optimizer`` (its schedule or None)."""
    from distrain._src.train.optimizer import build_optimizer
    from distrain._src.train.pretrained import new_state, pretrained_model

    base = None  # a pretrained model's hash and path: what its checkpoints are checked by
    if cfg.model.pretrained is not None:
        apply_fn, params, base = pretrained_model(cfg, strategy, say)
    else:
        model_fn = resolve_callable(cfg.model.fn, "model.fn")
        key = jax.random.key(cfg.seed)
        _check_call(model_fn, "model", cfg.model.fn, key=key, **cfg.model.kwargs)
        try:
            apply_fn, params = _init_model(model_fn, key, **cfg.model.kwargs)
        except TypeError as e:
            raise ConfigError(f"Config field 'model.fn': {e}") from e
    tx, schedule = build_optimizer(cfg.optimizer, run_steps=cfg.train.steps)
    # One compiled call instead of one small program per optimizer-state leaf. The RNG
    # is a raw uint32[2] key: typed key arrays cannot yet be placed across processes.
    state = jax.jit(new_state(cfg, tx, base))(params, jax.random.PRNGKey(cfg.seed + 1))
    milestone("model")
    return apply_fn, state, schedule


def _data(cfg: RunConfig, num_replicas: int) -> dict[str, Iterable[Any]]:
    """The splits of ``data.fn``, batched; a run of epochs checks its warmup here (the
    data says how long it is)."""
    from distrain._src.train.progress import steps_per_epoch_of

    data_fn = resolve_callable(cfg.data.fn, "data.fn")
    _check_call(data_fn, "data", cfg.data.fn, **cfg.data.kwargs)
    data = pipelines(cfg, load_data(cfg, data_fn), num_replicas)
    milestone("data")
    per_epoch = steps_per_epoch_of(data["train"])
    if cfg.train.steps is None and cfg.train.epochs is not None and per_epoch is not None:
        run = f"train.epochs={cfg.train.epochs} x {per_epoch} steps per epoch"
        cfg.optimizer.check_warmup(cfg.train.epochs * per_epoch, run)
    return data


def _steps(
    cfg: RunConfig, apply_fn: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[..., Any] | None]:
    """``train.train_step`` and ``train.eval_step`` (or None), with ``apply_fn`` and
    ``train.step_kwargs`` bound."""
    from distrain._src.train.pretrained import with_lora_dropout

    bind = dict(apply_fn=apply_fn, **cfg.train.step_kwargs)
    train_fn = resolve_callable(cfg.train.train_step, "train.train_step")
    _check_call(train_fn, "train", cfg.train.train_step, None, None, **bind)
    train_step = with_lora_dropout(functools.partial(train_fn, **bind), cfg)
    eval_step = None
    if cfg.train.eval_step is not None:
        eval_fn = resolve_callable(cfg.train.eval_step, "train.eval_step")
        _check_call(eval_fn, "train", cfg.train.eval_step, None, None, **bind)
        eval_step = functools.partial(eval_fn, **bind)
    return train_step, eval_step


def _final_evaluation(
    trainer: Any, state: Any, test: Iterable[Any], ledger: Any, say: Callable[[str], None]
) -> dict[str, float]:
    """The test split's metrics, printed; Ctrl-C here says the finished state is kept."""
    try:
        with ledger.phase("evaluation") if ledger is not None else contextlib.nullcontext():
            test_metrics: dict[str, float] = trainer.evaluate(state, test)
    except KeyboardInterrupt:
        raise RunInterrupted(_interrupted(trainer, evaluating=True)) from None
    shown = " ".join(f"{k}={v:.4f}" for k, v in test_metrics.items())
    say(f"final test: {shown}")
    if "accuracy" in test_metrics:
        say(f"test accuracy: {100 * test_metrics['accuracy']:.2f}%")
    return test_metrics
