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

This module holds the top of the schema (:class:`RunConfig`) and reads configs (files,
overrides, plain data); the sections are in ``strategy_config.py`` (``strategy``),
``training_config.py`` (``model``, ``data``, ``optimizer``, ``train``) and
``outputs_config.py`` (``logging``, ``checkpoint``, ``evaluator``),
``fault_isolation_config.py`` (``fault_isolation``), and the errors' wording in
``config_errors.py``.

Example:
  >>> cfg = load_config("configs/quickstart.yaml", overrides=["train.epochs=2"])
  >>> cfg.train.epochs
  2
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pydantic
import yaml
from pydantic import Field

from distrain._src.train.config_errors import ConfigError, is_section, translate, unknown_key
from distrain._src.train.config_section import ConfigSection
from distrain._src.train.fault_isolation_config import FaultIsolationConfig
from distrain._src.train.outputs_config import (
    CheckpointConfig,
    EvaluatorConfig,
    LoggingConfig,
    MLflowConfig,
    WandbConfig,
)
from distrain._src.train.strategy_config import StrategyConfig
from distrain._src.train.training_config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EvaluatorConfig",
    "FaultIsolationConfig",
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


class RunConfig(ConfigSection):
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
    fault_isolation: FaultIsolationConfig | None = None

    @pydantic.field_validator(*_SECTIONS, mode="before")
    @classmethod
    def _empty_section_is_defaults(cls, value: Any) -> Any:
        return {} if value is None else value  # `logging:` with nothing under it

    @pydantic.model_validator(mode="after")
    def _one_kind_of_islands(self) -> RunConfig:
        if self.fault_isolation is not None and self.strategy.name == "diloco":
            raise ConfigError(
                "fault_isolation (islands in separate processes, under distrain launch "
                "--islands N) and strategy.name=diloco (islands inside one program) are two "
                "ways to train islands; received both. Keep one: for fault_isolation, "
                "strategy names what runs inside each island (e.g. mirrored)."
            )
        return self

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
