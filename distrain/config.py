"""Run configs (``dt.config``): the YAML files ``distrain train --config`` runs, from Python.

A config names the model, data and step functions by import path
(``package.module:function``); :func:`load_config` reads and validates one (with
``key=value`` overrides, as on the command line), :func:`run_config` trains it and
:func:`resolve_callable` imports what a field names and :func:`build_optimizer` builds the
optax optimizer of an ``optimizer`` section, for entry points of your own.

Example:
  >>> cfg = dt.config.load_config("configs/quickstart.yaml", ["train.epochs=1"])
  >>> result = dt.config.run_config(cfg, progress_bar=False)
  >>> result.test_metrics["accuracy"]
"""

from distrain._src.train.config import OptimizerConfig as OptimizerConfig
from distrain._src.train.config import RunConfig as RunConfig
from distrain._src.train.config import load_config as load_config
from distrain._src.train.config_errors import ConfigError as ConfigError
from distrain._src.train.import_paths import resolve_callable as resolve_callable
from distrain._src.train.optimizer import build_optimizer as build_optimizer
from distrain._src.train.run import RunResult as RunResult
from distrain._src.train.run import run_config as run_config

__all__ = [
    "ConfigError",
    "OptimizerConfig",
    "RunConfig",
    "RunResult",
    "build_optimizer",
    "load_config",
    "resolve_callable",
    "run_config",
]
