"""Run configs: pydantic models, loaded from YAML and checked field by field.

A config describes one training run for ``distrain train --config FILE``: the
strategy, the model, data and step functions (named by import path
``package.module:function``, so the CLI runs your own code; the shipped configs name
``examples.classification``), the optimizer, the loop, logging and checkpoints.

pydantic does the checking (strict: ``1`` is not a bool, ``"5"`` is not an int; unknown
keys are refused); this module turns its errors into one sentence per problem that
names the field, what it must be and what it received, and suggests the closest valid
key or choice. A key repeated in one mapping names both lines, and a file that is
missing or not YAML says so. ``key=value`` overrides (``train.epochs=3``) are parsed as
YAML values and checked the same way.

Example:
  >>> cfg = load_config("configs/quickstart.yaml", overrides=["train.epochs=2"])
  >>> cfg.train.epochs
  2
"""

from __future__ import annotations

import os
import typing
from collections.abc import Sequence
from typing import Any, Literal

import pydantic
import yaml
from pydantic import Field

from distrain._src.train.config_errors import ConfigError, is_section, translate, unknown_key

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EvaluatorConfig",
    "LoggingConfig",
    "MLflowConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "ScheduleConfig",
    "StrategyConfig",
    "TrainConfig",
    "WandbConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
]

_IMPORT_PATH = "an import path 'package.module:function'"
PRETRAINED_FN = "distrain.models:from_pretrained"


class _Section(pydantic.BaseModel):
    # strict: YAML's 1 is not a bool and '5' is not an int (ints still widen to float).
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class OuterOptimizerConfig(_Section):
    """DiLoCo's outer optimizer: ``getattr(optax, name)(learning_rate, **kwargs)``;
    DiLoCo's is the default, Nesterov SGD with learning rate 0.7 and momentum 0.9."""

    name: str = "sgd"
    learning_rate: float = Field(default=0.7, gt=0, allow_inf_nan=False)
    kwargs: dict[str, Any] = {"momentum": 0.9, "nesterov": True}


class IslandsConfig(_Section):
    """``strategy.islands`` for ``strategy.name: diloco`` (``docs/islands.md``).

    Attributes:
      islands: the number of islands (equal groups of the devices).
      sync_every: ``H``, inner steps per round.
      outer_optimizer: the outer optimizer (default DiLoCo's).
      fragments, fragment_sync_delay, fragment_update_alpha, outer_dtype: Streaming
        DiLoCo's, as ``dt.experimental.DiLoCoStrategy`` takes them.
    """

    islands: pydantic.PositiveInt = Field(
        description="the number of islands, which must divide the devices, e.g. 4"
    )
    sync_every: pydantic.PositiveInt = Field(
        description="H, the inner steps between outer steps, e.g. 50"
    )
    outer_optimizer: OuterOptimizerConfig = OuterOptimizerConfig()
    fragments: pydantic.PositiveInt | list[str] = 1
    fragment_sync_delay: pydantic.NonNegativeInt = 0
    fragment_update_alpha: float = Field(default=0.0, ge=0.0, le=1.0)
    outer_dtype: Literal["float32", "bfloat16", "int8", "int4"] = "float32"


class StrategyConfig(_Section):
    """Which strategy runs the replicas.

    Attributes:
      name: ``mirrored`` (all local devices), ``one_device``, ``default`` (no
        distribution), ``multi_worker_mirrored``, ``central_storage``, ``tpu`` (every
        chip of the TPU slice, on every host: ``dt.TPUStrategy``) or ``diloco``
        (islands: ``islands`` below).
      devices: for ``mirrored``/``central_storage``: device names like ``"cpu:0"``;
        default all local devices. For ``one_device``: the first entry (default the
        first device).
      shard_state: for ``mirrored``/``multi_worker_mirrored``/``tpu``: store parameters and
        optimizer state split over the devices (``true``), or over each process's
        devices with a copy per process (``process``; docs/scaling.md).
      devices_per_replica: for ``mirrored``/``multi_worker_mirrored``/``tpu``: devices each
        replica spans (FSDP inside a replica; ``process``: one replica per process), or
        its named inner axes, e.g. ``{fsdp: 4, tensor: 2}`` (docs/scaling.md).
      layout: with ``devices_per_replica``: ``{path pattern: spec}`` rules, a spec being
        a list with one entry per dimension: an inner axis, a list of axes, a logical
        name or ``null``, e.g. ``{"mlp/fc/kernel": [fsdp, tensor]}``; or the import path
        of rules kept in code (``distrain.models:TENSOR_PARALLEL_LAYOUT``).
      logical_axis_rules: ``{logical name: inner axis, list of axes or null}``.
      batch_layout: ``{batch leaf pattern: spec}`` (a spec as in ``layout``, its first
        entry ``null`` for the rows), e.g. ``{tokens: [null, context]}``.
      islands: with ``name: diloco`` (required there, refused elsewhere): the islands
        and their outer step (:class:`IslandsConfig`); the layout fields apply inside
        each island.
    """

    name: Literal[
        "mirrored",
        "one_device",
        "default",
        "multi_worker_mirrored",
        "central_storage",
        "tpu",
        "diloco",
    ] = "mirrored"
    devices: list[str] | None = None
    shard_state: bool | Literal["process"] = False
    devices_per_replica: (
        pydantic.PositiveInt | Literal["process"] | dict[str, pydantic.PositiveInt]
    ) = 1
    layout: dict[str, list[str | list[str] | None]] | str | None = None
    logical_axis_rules: dict[str, str | list[str] | None] | None = None
    batch_layout: dict[str, list[str | list[str] | None]] | None = None
    islands: IslandsConfig | None = None

    @pydantic.model_validator(mode="after")
    def _layouts_need_data_parallel(self) -> StrategyConfig:
        if (self.name == "diloco") != (self.islands is not None):
            raise ConfigError(
                "strategy.name=diloco needs strategy.islands (at least islands and "
                "sync_every), and strategy.islands applies to strategy.name=diloco only. "
                f"Received: strategy.name={self.name!r} and strategy.islands="
                f"{'set' if self.islands is not None else 'null'}."
            )
        if self.name == "tpu" and self.devices is not None:
            raise ConfigError(
                "strategy.devices does not apply to strategy.name=tpu (it takes every chip "
                f"of the slice). Received: strategy.devices={self.devices!r}; remove it, or "
                "use strategy.name=mirrored to choose this process's devices."
            )
        if self.name == "diloco" and self.shard_state:
            raise ConfigError(
                "strategy.shard_state does not apply to strategy.name=diloco (each island "
                "keeps its own copy). Received: strategy.shard_state="
                f"{self.shard_state!r}; remove it, or lay the state out inside each island "
                "with devices_per_replica."
            )
        for field, off in (
            ("shard_state", False),
            ("devices_per_replica", 1),
            ("layout", None),
            ("logical_axis_rules", None),
            ("batch_layout", None),
        ):
            if getattr(self, field) != off and self.name not in (
                "mirrored",
                "multi_worker_mirrored",
                "tpu",
                "diloco",
            ):
                raise ConfigError(
                    f"strategy.{field} applies to strategy.name mirrored, "
                    f"multi_worker_mirrored, tpu or diloco. Received: strategy.name="
                    f"{self.name!r}; set strategy.{field}="
                    f"{'null' if off is None else str(off).lower()} or change the strategy."
                )
        return self

    def layout_kwargs(self) -> dict[str, Any]:
        """``devices_per_replica``, ``layout`` and ``batch_layout`` (specs as
        PartitionSpecs) and ``logical_axis_rules``, as the strategy takes them."""
        from jax.sharding import PartitionSpec as P

        def entry(e: str | list[str] | None) -> str | tuple[str, ...] | None:
            return tuple(e) if isinstance(e, list) else e

        def specs(rules: dict[str, list[Any]] | None) -> dict[str, P] | None:
            return None if rules is None else {k: P(*map(entry, v)) for k, v in rules.items()}

        logical = (
            None
            if self.logical_axis_rules is None
            else {k: entry(v) for k, v in self.logical_axis_rules.items()}
        )
        return {
            "devices_per_replica": self.devices_per_replica,
            "layout": self.layout if isinstance(self.layout, str) else specs(self.layout),
            "logical_axis_rules": logical,
            "batch_layout": specs(self.batch_layout),
        }


class LoraSection(_Section):
    """``model.lora``: ``dt.models.LoraConfig`` (``targets`` null: its default)."""

    rank: pydantic.PositiveInt
    alpha: float = Field(gt=0, allow_inf_nan=False)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    targets: str | None = None


class ModelConfig(_Section):
    """The model: ``fn(key=jax.random.key(seed), **kwargs)``, or a Hugging Face directory.

    ``fn`` returns a ``flax.nnx.Module`` (its parameters become ``state.params`` and the
    step functions get ``apply_fn(params, x)``) or a tuple ``(apply_fn, params)``.

    Attributes:
      fn: import path ``package.module:function`` (required without ``pretrained``).
      kwargs: keyword arguments for ``fn``.
      pretrained, lora: a Hugging Face directory (``fn`` is then absent, ``kwargs``
        ``dt.models.from_pretrained``'s) and adapters for it (train/pretrained.py).
    """

    fn: str = Field(description=_IMPORT_PATH)
    kwargs: dict[str, Any] = {}
    pretrained: str | None = None
    lora: LoraSection | None = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _pretrained_or_fn(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("pretrained") is None:
            if isinstance(data, dict) and data.get("lora") is not None:
                raise ConfigError(
                    "Config field 'model.lora' adapts a pretrained model: set model.pretrained "
                    "(its Hugging Face directory) or remove model.lora."
                )
            return data
        if data.get("fn", PRETRAINED_FN) != PRETRAINED_FN:
            raise ConfigError(
                f"Config fields 'model.fn' ({data['fn']!r}) and 'model.pretrained' both name "
                "the model: remove model.fn (it is dt.models.from_pretrained) or model.pretrained."
            )
        return {"fn": PRETRAINED_FN, **data}


class LeafShape(_Section):
    """One batch leaf's row: its shape without the batch dimension, and its dtype."""

    shape: list[pydantic.NonNegativeInt]
    dtype: Literal["float32", "bfloat16", "float16", "int32", "int64", "uint8", "bool"] = "float32"


class DataConfig(_Section):
    """The data: ``fn(**kwargs)`` returns ``{"train": ..., "test": ...}`` (optionally
    ``"validation"``), each a dict of NumPy arrays (batched here with
    ``ArrayPipeline``) or an iterable of global batches (used as is).

    Attributes:
      fn: import path ``package.module:function`` (required).
      kwargs: keyword arguments for ``fn``.
      global_batch_size: rows per training step, summed over all replicas.
      eval_batch_size: rows per evaluation step (default ``global_batch_size``).
      shuffle: reshuffle the training rows every epoch.
      validation_split: split evaluated after epochs (``"validation"``, ``"test"`` or
        ``None`` for no validation during ``fit``).
      abstract: for ``distrain plan``: each batch leaf's row shape and dtype, e.g.
        ``{tokens: {shape: [2049], dtype: int32}}``, so that planning loads no data
        (without it, plan reads the ``train`` split's shapes from ``fn``).
    """

    fn: str = Field(description=_IMPORT_PATH)
    kwargs: dict[str, Any] = {}
    global_batch_size: int = Field(default=128, ge=1)
    eval_batch_size: int | None = Field(default=None, ge=1)
    shuffle: bool = True
    validation_split: str | None = "test"
    abstract: dict[str, LeafShape] | None = None


_DEFAULT_LEARNING_RATE = 1e-3


class ScheduleConfig(_Section):
    """An optax schedule of the step: ``getattr(optax.schedules, name)(**kwargs)``.

    Attributes:
      name: an optax schedule, e.g. ``warmup_cosine_decay_schedule``,
        ``cosine_decay_schedule``, ``linear_schedule``, ``exponential_decay``.
      kwargs: its keyword arguments, e.g. ``{init_value: 0.0, peak_value: 1.0e-3,
        warmup_steps: 100, decay_steps: 2000, end_value: 1.0e-4}``.
    """

    name: str = Field(description="an optax schedule, e.g. warmup_cosine_decay_schedule")
    kwargs: dict[str, Any] = {}

    @pydantic.model_validator(mode="after")
    def _step_counts_are_non_negative_ints(self) -> ScheduleConfig:
        for key, value in self.kwargs.items():
            # optax's step counts: warmup_steps, decay_steps, transition_steps, ...
            if not (key.endswith("steps") or key == "transition_begin"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"Config field 'optimizer.schedule.kwargs.{key}' must be an int >= 0 (a "
                    f"number of steps). Received: {value!r}."
                )
        return self


class OptimizerConfig(_Section):
    """An optax optimizer: ``getattr(optax, name)(learning_rate, **kwargs)``.

    With ``clip_global_norm``: ``optax.chain(optax.clip_by_global_norm(c), optimizer)``.

    Attributes:
      name: an optax function, e.g. ``adam``, ``adamw``, ``sgd``.
      learning_rate: the constant learning rate (without ``schedule``).
      kwargs: other keyword arguments, e.g. ``{b1: 0.9, weight_decay: 0.1}``.
      schedule: the learning rate as an optax schedule of the step instead of a
        constant (``None``: ``learning_rate``); ``distrain train`` logs its value as
        ``learning_rate``. ``learning_rate`` is then unused: setting it to anything
        but its default is an error (a dumped config, which holds the default, reloads).
      clip_global_norm: clip the gradients to this global norm before the optimizer
        (``None``: no clipping).
      weight_decay_mask: which parameters decay (optax's ``mask=``): ``"ndim >= 2"``
        (weight matrices and embeddings; not biases or norm scales, as GPT recipes do)
        or ``None`` (optax's default: all). Only for optimizers with weight decay.
      trainable: a regex of the parameter paths that train (``TrainState.create(
        trainable=)``); ``None``: the adapters with ``model.lora``, else all.
    """

    name: str = "adam"
    # A negative rate ascends the loss, zero trains nothing: both exit "successfully".
    learning_rate: float = Field(default=_DEFAULT_LEARNING_RATE, gt=0, allow_inf_nan=False)
    kwargs: dict[str, Any] = {}
    schedule: ScheduleConfig | None = None
    clip_global_norm: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    weight_decay_mask: Literal["ndim >= 2"] | None = None
    trainable: str | None = None

    @pydantic.model_validator(mode="after")
    def _one_learning_rate(self) -> OptimizerConfig:
        if self.schedule is not None and self.learning_rate != _DEFAULT_LEARNING_RATE:
            raise ConfigError(
                "Config fields 'optimizer.learning_rate' and 'optimizer.schedule' both set the "
                f"learning rate. Received: optimizer.learning_rate={self.learning_rate!r} and "
                f"optimizer.schedule.name={self.schedule.name!r}. Remove learning_rate (the "
                "schedule's values are the learning rate) or remove the schedule."
            )
        return self

    def check_warmup(self, run_steps: int, run: str) -> None:
        """Raises ConfigError if ``schedule.kwargs.warmup_steps`` exceeds the run's
        ``run_steps`` (``run`` says where that number comes from)."""
        warmup = self.schedule.kwargs.get("warmup_steps") if self.schedule is not None else None
        if isinstance(warmup, int) and warmup > run_steps:
            raise ConfigError(
                f"Config field 'optimizer.schedule.kwargs.warmup_steps' ({warmup}) is longer "
                f"than the run ({run}), so the learning rate would never reach its peak. Use "
                f"warmup_steps <= {run_steps} or a longer run."
            )


class TrainConfig(_Section):
    """The loop.

    Attributes:
      train_step: import path of ``step(state, batch, *, apply_fn, **step_kwargs) ->
        (state, metrics)`` (required).
      eval_step: import path of ``step(state, batch, *, apply_fn, **step_kwargs) ->
        metrics``, or ``None``.
      step_kwargs: extra keyword arguments bound into both steps.
      epochs: passes over the training data (``None``: as many as ``steps`` needs).
      steps: total training steps (a cap when ``epochs`` is also given).
      steps_per_execution: steps fused into one compiled dispatch.
      log_every: steps between host syncs for metrics.
      validation_freq: validate every this many epochs.
      grad_accum_steps: micro-batches per optimizer update (``Trainer(grad_accum_steps)``).
      policy: mixed precision: ``float32``, ``mixed_bfloat16`` or ``mixed_float16``
        (``TrainState.create(policy=...)``; the step must take gradients with
        ``state.value_and_grad``, as the classification example's step does).
    """

    train_step: str = Field(description=_IMPORT_PATH)
    eval_step: str | None = None
    step_kwargs: dict[str, Any] = {}
    epochs: int | None = Field(default=1, ge=1)
    steps: int | None = Field(default=None, ge=1)
    steps_per_execution: int = Field(default=1, ge=1)
    log_every: int = Field(default=50, ge=1)
    validation_freq: int = Field(default=1, ge=1)
    grad_accum_steps: int = Field(default=1, ge=1)
    policy: Literal["float32", "mixed_bfloat16", "mixed_float16"] = "float32"

    @pydantic.model_validator(mode="after")
    def _epochs_or_steps(self) -> TrainConfig:
        if self.epochs is None and self.steps is None:
            raise ConfigError("train.epochs and train.steps are both null; set at least one.")
        return self


class WandbConfig(_Section):
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


class MLflowConfig(_Section):
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


class LoggingConfig(_Section):
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


class CheckpointConfig(_Section):
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


class EvaluatorConfig(_Section):
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


_SECTIONS = (
    "strategy",
    "model",
    "data",
    "optimizer",
    "train",
    "logging",
    "checkpoint",
    "evaluator",
)


class RunConfig(_Section):
    """A whole run (the top level of a YAML config).

    ``model``, ``data`` and ``train`` are required: they name your code.

    Attributes:
      name: a label for the run (printed, and used in log directory names).
      seed: seeds the model initialisation and the data order (NumPy seeds are >= 0).
    """

    name: str = "run"
    seed: int = Field(default=0, ge=0)
    strategy: StrategyConfig = StrategyConfig()
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    evaluator: EvaluatorConfig = EvaluatorConfig()

    @pydantic.field_validator(*_SECTIONS, mode="before")
    @classmethod
    def _empty_section_is_defaults(cls, value: Any) -> Any:
        return {} if value is None else value  # `logging:` with nothing under it

    @pydantic.model_validator(mode="after")
    def _warmup_fits_the_run(self) -> RunConfig:
        schedule, steps = self.optimizer.schedule, self.train.steps
        if schedule is None or steps is None:
            return self  # a run of epochs: run_config checks once the data says how long
        self.optimizer.check_warmup(steps, f"train.steps is {steps}")
        return self


# ----------------------------------------------------------------- dicts and overrides


def config_from_dict(data: Any) -> RunConfig:
    """Builds and checks a :class:`RunConfig` from plain data (e.g. parsed YAML).

    Raises:
      ConfigError: unknown keys (with the closest valid key), wrong types, bad values,
        all of them in one message.
    """
    try:
        return RunConfig.model_validate(data)
    except pydantic.ValidationError as e:
        raise translate(e, RunConfig) from None


def config_to_dict(config: pydantic.BaseModel) -> dict[str, Any]:
    """The plain-data form of a config (what YAML would hold)."""
    return config.model_dump()


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Applies ``key.sub=value`` overrides to raw config data (values parsed as YAML).

    Raises:
      ConfigError: an override without ``=``, or one whose key is not in the schema.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"Override {item!r} must look like key=value, e.g. train.epochs=3.")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"Override {item!r}: cannot parse the value as YAML: {e}") from e
        _set_path(data, key.split("."), value, key)
    return data


def _set_path(data: dict[str, Any], parts: list[str], value: Any, full: str) -> None:
    tp: Any = RunConfig
    node = data
    for i, part in enumerate(parts):
        if is_section(tp):
            if part not in tp.model_fields:
                raise ConfigError(unknown_key(full, part, ".".join(parts[:i]), tp))
            tp = tp.model_fields[part].annotation
        else:
            tp = None  # inside a free-form mapping such as model.kwargs
        if i == len(parts) - 1:
            node[part] = value
            return
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"Override {full!r}: {'.'.join(parts[: i + 1])!r} is {child!r}, not a section."
            )
        node = child


# ------------------------------------------------------------------------------ files


class _DuplicateKeyError(yaml.YAMLError):
    """A mapping that repeats a key (PyYAML silently keeps the last value)."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges; keys written next to it override by design
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: let PyYAML report it
                continue
            if first is not None:
                raise _DuplicateKeyError(
                    f"duplicate key {key!r} at line {line} (first at line {first}); YAML would "
                    "silently keep the last value. Keep one of them."
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RunConfig:
    """Reads a YAML config file, applies overrides, and checks it.

    Args:
      path: the ``.yaml`` file.
      overrides: ``key.sub=value`` strings, applied before checking.

    Raises:
      ConfigError: the file is missing, unreadable, not YAML, repeats a key, or does
        not match the schema (unknown keys, wrong types, out-of-range values).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        near = ""
        folder = os.path.dirname(path) or "."
        if os.path.isdir(folder):
            yamls = sorted(f for f in os.listdir(folder) if f.endswith((".yaml", ".yml")))
            if yamls:
                near = f" YAML files in {folder!r}: {', '.join(yamls)}."
        raise ConfigError(f"Config file {path!r} does not exist.{near}")
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"Cannot read config file {path!r}: {e.strerror or e}.") from e
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKeyError as e:
        raise ConfigError(f"Config file {path!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file {path!r} is not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file {path!r} must hold a mapping of keys to values at the top level. "
            f"Received: {type(data).__name__}."
        )
    try:
        return config_from_dict(apply_overrides(data, overrides))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
