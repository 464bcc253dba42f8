"""Run configs: typed dataclasses, loaded from YAML and checked field by field.

A config describes one training run for ``distrain train --config FILE``: the
strategy, the model, data and step functions (named by import path
``package.module:function``, so your own code works as well as the built-in
``distrain.train.zoo``), the optimizer, the loop, logging and checkpoints.

Loading is strict: an unknown key is an error that suggests the closest valid key, a
value of the wrong type or out of range (a learning rate <= 0, a batch size < 1) names
the field and the value, a key repeated in one mapping names both lines, and a file
that is missing or not YAML says so. ``key=value`` overrides (``train.epochs=3``) are parsed as YAML
values and checked the same way.

Example:
  >>> cfg = load_config("configs/quickstart.yaml", overrides=["train.epochs=2"])
  >>> cfg.train.epochs
  2
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "StrategyConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
]


class ConfigError(ValueError):
    """A config file or override that does not match the schema."""


@dataclasses.dataclass
class StrategyConfig:
    """Which strategy runs the replicas.

    Attributes:
      name: ``mirrored`` (all local devices), ``one_device``, ``default`` (no
        distribution), ``multi_worker_mirrored`` or ``central_storage``.
      devices: for ``mirrored``/``central_storage``: device names like ``"cpu:0"``;
        default all local devices. For ``one_device``: the first entry (default the
        first device).
      shard_state: for ``mirrored``/``multi_worker_mirrored``: store parameters and
        optimizer state split over the devices (``true``), or over each process's
        devices with a copy per process (``process``; docs/scaling.md).
    """

    name: Literal[
        "mirrored", "one_device", "default", "multi_worker_mirrored", "central_storage"
    ] = "mirrored"
    devices: list[str] | None = None
    shard_state: bool | Literal["process"] = False

    def __post_init__(self) -> None:
        if self.shard_state and self.name not in ("mirrored", "multi_worker_mirrored"):
            raise ConfigError(
                "strategy.shard_state applies to strategy.name mirrored or "
                f"multi_worker_mirrored. Received: strategy.name={self.name!r}; set "
                "strategy.shard_state=false or change the strategy."
            )


@dataclasses.dataclass
class ModelConfig:
    """The model: ``fn(key=jax.random.key(seed), **kwargs)``.

    ``fn`` returns a ``flax.nnx.Module`` (its parameters become ``state.params`` and the
    step functions get ``apply_fn(params, x)``) or a tuple ``(apply_fn, params)``.

    Attributes:
      fn: import path ``package.module:function``.
      kwargs: keyword arguments for ``fn``.
    """

    fn: str = "distrain.train.zoo:mlp"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DataConfig:
    """The data: ``fn(**kwargs)`` returns ``{"train": ..., "test": ...}`` (optionally
    ``"validation"``), each a dict of NumPy arrays (batched here with
    ``ArrayPipeline``) or an iterable of global batches (used as is).

    Attributes:
      fn: import path ``package.module:function``.
      kwargs: keyword arguments for ``fn``.
      global_batch_size: rows per training step, summed over all replicas.
      eval_batch_size: rows per evaluation step (default ``global_batch_size``).
      shuffle: reshuffle the training rows every epoch.
      validation_split: split evaluated after epochs (``"validation"``, ``"test"`` or
        ``None`` for no validation during ``fit``).
    """

    fn: str = "distrain.train.zoo:digits"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    global_batch_size: int = 128
    eval_batch_size: int | None = None
    shuffle: bool = True
    validation_split: str | None = "test"

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ConfigError(
                f"data.global_batch_size must be >= 1 (rows per step over all replicas). "
                f"Received: {self.global_batch_size}."
            )
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ConfigError(
                f"data.eval_batch_size must be >= 1 or null (null: data.global_batch_size). "
                f"Received: {self.eval_batch_size}."
            )


@dataclasses.dataclass
class OptimizerConfig:
    """An optax optimizer: ``getattr(optax, name)(learning_rate, **kwargs)``.

    Attributes:
      name: an optax function, e.g. ``adam``, ``adamw``, ``sgd``.
      learning_rate: the (constant) learning rate.
      kwargs: other keyword arguments, e.g. ``{b1: 0.9}``.
    """

    name: str = "adam"
    learning_rate: float = 1e-3
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # A negative rate ascends the loss, zero trains nothing: both exit "successfully".
        if not math.isfinite(self.learning_rate) or self.learning_rate <= 0:
            raise ConfigError(
                "optimizer.learning_rate must be a positive finite number, e.g. 0.001. "
                f"Received: {self.learning_rate!r}."
            )


@dataclasses.dataclass
class TrainConfig:
    """The loop.

    Attributes:
      train_step: import path of ``step(state, batch, *, apply_fn, **step_kwargs) ->
        (state, metrics)``.
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
        ``state.value_and_grad``, as the built-in classification step does).
    """

    train_step: str = "distrain.train.zoo:classification_train_step"
    eval_step: str | None = "distrain.train.zoo:classification_eval_step"
    step_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    epochs: int | None = 1
    steps: int | None = None
    steps_per_execution: int = 1
    log_every: int = 50
    validation_freq: int = 1
    grad_accum_steps: int = 1
    policy: Literal["float32", "mixed_bfloat16", "mixed_float16"] = "float32"

    def __post_init__(self) -> None:
        for name in ("epochs", "steps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"train.{name} must be >= 1 or null. Received: {v}.")
        if self.epochs is None and self.steps is None:
            raise ConfigError("train.epochs and train.steps are both null; set at least one.")
        for name in ("steps_per_execution", "log_every", "validation_freq", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1. Received: {getattr(self, name)}.")


@dataclasses.dataclass
class LoggingConfig:
    """Where progress goes. Files are written under ``dir`` by the chief process.

    Attributes:
      dir: run directory for TensorBoard/CSV/JSON logs (``None``: no files).
      progress_bar: draw a tqdm progress bar.
      tensorboard: write TensorBoard event files to ``dir``.
      csv: write ``dir/epochs.csv``.
      jsonl: write ``dir/metrics.jsonl``.
    """

    dir: str | None = None
    progress_bar: bool = True
    tensorboard: bool = False
    csv: bool = False
    jsonl: bool = False


@dataclasses.dataclass
class CheckpointConfig:
    """Checkpoints (orbax, asynchronous).

    Attributes:
      dir: keep checkpoints here with ``ModelCheckpoint`` (``None``: none).
      save_freq: ``"epoch"`` or a number of steps.
      max_to_keep: newest checkpoints kept in ``dir``.
      backup_dir: resume from and back up to this directory with ``BackupAndRestore``:
        run the same command again after a crash and it continues exactly.
      backup_freq: ``"epoch"`` or a number of steps, for ``backup_dir``.
    """

    dir: str | None = None
    save_freq: int | str = "epoch"
    max_to_keep: int = 3
    backup_dir: str | None = None
    backup_freq: int | str = "epoch"

    def __post_init__(self) -> None:
        if self.max_to_keep < 1:
            raise ConfigError(
                f"checkpoint.max_to_keep must be >= 1. Received: {self.max_to_keep}."
            )
        for name in ("save_freq", "backup_freq"):
            v = getattr(self, name)
            if isinstance(v, str) and v != "epoch" or isinstance(v, int) and v < 1:
                raise ConfigError(
                    f"checkpoint.{name} must be 'epoch' or a positive number of steps. "
                    f"Received: {v!r}."
                )


@dataclasses.dataclass
class RunConfig:
    """A whole run (the top level of a YAML config).

    Attributes:
      name: a label for the run (printed, and used in log directory names).
      seed: seeds the model initialisation and the data order.
    """

    name: str = "run"
    seed: int = 0
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0 (NumPy seeds are non-negative). Received: "
                              f"{self.seed}.")


# ---------------------------------------------------------------------------- checking


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Checks ``value`` against type ``tp``; returns it (ints widened to float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        # cast: tp is a type hint, so a dataclass here is the class, never an instance.
        return _from_dict(typing.cast(type, tp), value, path)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, path)
            except ConfigError as e:
                errors.append(e)
        raise _type_error(path, tp, value)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(
            f"Config field {path!r} must be one of {_type_name(tp)}. Received: {value!r}."
            + _suggest(str(value), [str(a) for a in typing.get_args(tp)])
        )
    if tp is type(None):
        if value is None:
            return None
        raise _type_error(path, tp, value)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(path, tp, value)
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(path, tp, value)
        _, item = typing.get_args(tp)
        return {str(k): _convert(v, item, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _type_error(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, tp, value)
    raise TypeError(f"Unsupported config field type {tp!r} at {path!r}.")  # a schema bug


def _type_error(path: str, tp: Any, value: Any) -> ConfigError:
    hint = ""
    if isinstance(value, str) and typing.get_origin(tp) is None and tp in (int, float):
        hint = " (YAML reads 1e-3 as a string; write 1.0e-3)" if "e" in value.lower() else ""
    return ConfigError(
        f"Config field {path!r} must be {_type_name(tp)}. Received: {value!r} "
        f"({type(value).__name__}){hint}."
    )


def _suggest(key: str, valid: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" Did you mean {prefix + close[0]!r}?" if close else ""


def _prefix(path: str) -> str:
    return f"{path}." if path else ""


def _from_dict(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        where = f"Config section {path!r}" if path else "A config file"
        raise ConfigError(
            f"{where} must be a mapping of keys to values. Received: {data!r} "
            f"({type(data).__name__})."
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(
                f"Unknown config key {full!r}.{_suggest(str(key), names, _prefix(path))} Valid keys"
                f"{' in ' + repr(path) if path else ''}: {', '.join(names)}."
            )
        kwargs[key] = _convert(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # a required field without default
        raise ConfigError(f"Config section {path or '(top level)'!r}: {e}.") from e


def config_from_dict(data: Any) -> RunConfig:
    """Builds and checks a :class:`RunConfig` from plain data (e.g. parsed YAML).

    Raises:
      ConfigError: unknown keys (with the closest valid key), wrong types, bad values.
    """
    return _from_dict(RunConfig, data, "")


def config_to_dict(config: Any) -> dict[str, Any]:
    """The plain-data form of a config (what YAML would hold)."""
    return dataclasses.asdict(config)


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
    cls: Any = RunConfig
    node = data
    for i, part in enumerate(parts):
        if cls is not None:
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                where = ".".join(parts[:i])
                raise ConfigError(
                    f"Unknown config key {full!r}."
                    f"{_suggest(part, names, _prefix(where))} Valid keys"
                    f"{' in ' + repr(where) if where else ''}: {', '.join(names)}."
                )
            field_type = typing.get_type_hints(cls)[part]
            cls = field_type if dataclasses.is_dataclass(field_type) else None
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
