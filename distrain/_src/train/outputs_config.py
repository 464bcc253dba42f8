"""The sections of a run config that say where a run's results go: ``logging`` (files,
the goodput ledger, Weights & Biases and MLflow), ``checkpoint`` (kept checkpoints and
the backups a rerun resumes from) and ``evaluator`` (the sidecar evaluator task).

Example:
  >>> CheckpointConfig(backup_dir="/tmp/run/backup", backup_freq=100).max_to_keep
  3
"""

from __future__ import annotations

import typing
from typing import Literal

import pydantic
from pydantic import Field

from distrain._src.train.config_errors import ConfigError
from distrain._src.train.config_section import ConfigSection

__all__ = ["CheckpointConfig", "EvaluatorConfig", "LoggingConfig", "MLflowConfig", "WandbConfig"]


class WandbConfig(ConfigSection):
    """``dt.callbacks.WandbLogger``: the run in Weights & Biases (``distrain[wandb]``).

    The run's config is this file after overrides; its name defaults to ``name``.

    Attributes:
      project: the W&B project.
      entity: the team or user (``None``: yours).
      group: groups runs.
      tags: labels of the run.
      mode: ``online``, ``offline`` or ``disabled`` (``None``: ``WANDB_MODE`` or online).
      dir: where W&B writes its files (``None``: ``WANDB_DIR`` or the working directory).
      log_checkpoint: upload the newest ``checkpoint.dir`` checkpoint at the end.
    """

    project: str = Field(description="the name of a W&B project, e.g. mnist")
    entity: str | None = None
    group: str | None = None
    tags: list[str] = []
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None
    log_checkpoint: bool = False


class MLflowConfig(ConfigSection):
    """``dt.callbacks.MLflowLogger``: the run in MLflow (``distrain[mlflow]``).

    The config file after overrides becomes the run's parameters; its name is ``name``.

    Attributes:
      experiment: the experiment (created if missing).
      tracking_uri: where runs go (``None``: ``MLFLOW_TRACKING_URI`` or MLflow's default).
      tags: tags of the run.
      log_checkpoint: upload the newest ``checkpoint.dir`` checkpoint at the end.
    """

    experiment: str = "distrain"
    tracking_uri: str | None = None
    tags: dict[str, str] = {}
    log_checkpoint: bool = False


class LoggingConfig(ConfigSection):
    """Where progress goes. Files are written under ``dir`` by the chief process.

    Attributes:
      dir: run directory for TensorBoard/CSV/JSON logs (``None``: no files).
      progress_bar: draw a tqdm progress bar.
      tensorboard: write TensorBoard event files to ``dir``.
      csv: write ``dir/epochs.csv``.
      jsonl: write ``dir/metrics.jsonl``.
      goodput: keep the goodput ledger ``dir/goodput.jsonl`` (``distrain goodput DIR``
        reads it); on by default when ``dir`` is set.
      goodput_interval: seconds between the ledger's progress records (what a SIGKILL can
        leave unaccounted, then counted as downtime).
      wandb: log to Weights & Biases (``None``: not).
      mlflow: log to MLflow (``None``: not).
    """

    dir: str | None = None
    progress_bar: bool = True
    tensorboard: bool = False
    csv: bool = False
    jsonl: bool = False
    goodput: bool = True
    goodput_interval: float = Field(default=1.0, gt=0)
    wandb: WandbConfig | None = None
    mlflow: MLflowConfig | None = None


_Frequency = Literal["epoch"] | typing.Annotated[int, Field(ge=1)]


class CheckpointConfig(ConfigSection):
    """Checkpoints (orbax, asynchronous).

    Attributes:
      dir: keep checkpoints here with ``ModelCheckpoint`` (``None``: none).
      save_freq: ``"epoch"`` or a number of steps.
      max_to_keep: newest checkpoints kept in ``dir``.
      backup_dir: resume from and back up to this directory with ``BackupAndRestore``:
        run the same command again after a crash and it continues exactly.
      backup_freq: ``"epoch"`` or a number of steps, for ``backup_dir``.
      local_dir: a fast local tier for the backups (node-local, e.g. ``/dev/shm/run``):
        a backup every ``local_freq`` steps, each process's shards mirrored on a peer
        process; a restart resumes from the newest backup that verifies in either.
      local_freq: steps between local backups (with ``local_dir``).
      delete_backups: delete the backups (and the local tier) when the command's work is
        done: training, then the final evaluation. Until then the finished state is
        backed up, so a run killed in its final evaluation does not train again (its
        rerun only evaluates). False keeps them (``BackupAndRestore``'s
        ``delete_checkpoint=False``): a rerun then only evaluates.
    """

    dir: str | None = None
    save_freq: _Frequency = "epoch"
    max_to_keep: int = Field(default=3, ge=1)
    backup_dir: str | None = None
    backup_freq: _Frequency = "epoch"
    local_dir: str | None = None
    local_freq: int | None = Field(default=None, ge=1)
    delete_backups: bool = True

    @pydantic.model_validator(mode="after")
    def _local_tier_of_the_backups(self) -> CheckpointConfig:
        if self.local_dir is None and self.local_freq is None:
            return self
        if self.backup_dir is None or self.local_dir is None or self.local_freq is None:
            raise ConfigError(
                "Config fields 'checkpoint.local_dir' and 'checkpoint.local_freq' add a local "
                "tier to the backups: both are needed, with 'checkpoint.backup_dir'. Received: "
                f"backup_dir={self.backup_dir!r}, local_dir={self.local_dir!r}, "
                f"local_freq={self.local_freq!r}."
            )
        return self


class EvaluatorConfig(ConfigSection):
    """The evaluator task (``dt.SidecarEvaluator``): what ``distrain train`` does in a
    process whose ``TF_CONFIG`` task (or ``DISTRAIN_TASK_TYPE``, set by ``distrain launch
    --evaluator``) is ``evaluator``, and ``distrain evaluate --follow``.

    Attributes:
      checkpoint_dir: the directory to follow (``None``: ``checkpoint.dir``).
      split: the split of ``data.fn`` to evaluate on.
      every_checkpoint: evaluate every checkpoint in order (``false``: the newest each
        time, skipping those it missed, as TensorFlow does).
      poll_interval: seconds between looks at the directory.
      timeout: seconds to wait for a first checkpoint (``None``: no limit).
      max_evaluations: stop after this many (``None``: at the training's final checkpoint).
      steps: batches per evaluation (``None``: the whole split).
      workdir: its progress file, goodput ledger and logs (``None``:
        ``logging.dir/evaluator``, else ``<checkpoint_dir>/sidecar``).
    """

    checkpoint_dir: str | None = None
    split: str = "test"
    every_checkpoint: bool = False
    poll_interval: float = Field(default=5.0, gt=0)
    timeout: float | None = Field(default=None, ge=0)
    max_evaluations: int | None = Field(default=None, ge=1)
    steps: int | None = Field(default=None, ge=1)
    workdir: str | None = None
