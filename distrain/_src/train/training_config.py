"""The sections of a run config that say what trains and how: ``model`` (your
function, or a Hugging Face directory and its adapters), ``data``, ``optimizer`` (with
its schedule) and ``train`` (the loop and its step functions).

Functions are named by import path ``package.module:function``; ``train/run.py``
imports and calls them.

Example:
  >>> OptimizerConfig(name="adamw", learning_rate=3e-4).kwargs
  {}
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from distrain._src.train.config_errors import ConfigError
from distrain._src.train.config_section import ConfigSection

__all__ = [
    "PRETRAINED_FN",
    "DataConfig",
    "LeafShape",
    "LoraSection",
    "ModelConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainConfig",
]

_IMPORT_PATH = "an import path 'package.module:function'"
PRETRAINED_FN = "distrain.models:from_pretrained"


class LoraSection(ConfigSection):
    """``model.lora``: ``dt.models.LoraConfig`` (``targets`` null: its default)."""

    rank: pydantic.PositiveInt
    alpha: float = Field(gt=0, allow_inf_nan=False)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    targets: str | None = None


class ModelConfig(ConfigSection):
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


class LeafShape(ConfigSection):
    """One batch leaf's row: its shape without the batch dimension, and its dtype."""

    shape: list[pydantic.NonNegativeInt]
    dtype: Literal["float32", "bfloat16", "float16", "int32", "int64", "uint8", "bool"] = "float32"


class DataConfig(ConfigSection):
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


class ScheduleConfig(ConfigSection):
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


class OptimizerConfig(ConfigSection):
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


class TrainConfig(ConfigSection):
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
