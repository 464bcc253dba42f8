"""The optimizer a run config names: optax by name, a schedule, clipping, a decay mask.

``config.py`` checks the ``optimizer`` section's shape (types, ranges, which fields go
together); this module turns it into optax and checks what only optax can say: that
the names exist, that the keyword arguments fit their functions, that the schedule
gives finite, non-negative learning rates over the run. Each problem is a
``ConfigError`` naming the field.

``optimizer.schedule``'s value is logged as ``learning_rate`` by
:class:`LearningRateLogger`, a callback that ``run_config`` puts before the loggers.
It is read on the host from the optimizer's own step count at the host syncs the
Trainer already makes, not returned as a step metric: step metrics are averaged over
each log window (and epoch), and the average of a schedule over 50 steps is not its
value at any of them.

Example:
  >>> cfg = OptimizerConfig(name="adamw", clip_global_norm=1.0,
  ...                       schedule={"name": "cosine_decay_schedule",
  ...                                 "kwargs": {"init_value": 1e-3, "decay_steps": 100}})
  >>> tx, schedule = build_optimizer(cfg, run_steps=100)
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distrain._src.train.callbacks.base import Callback, Logs, StepInfo
from distrain._src.train.config_errors import ConfigError
from distrain._src.train.training_config import OptimizerConfig, ScheduleConfig

__all__ = [
    "WEIGHT_DECAY_MASKS",
    "LearningRateLogger",
    "build_optimizer",
    "build_schedule",
    "optimizer_by_name",
    "schedule_count",
    "schedule_names",
]

# optax schedules that take other schedules or wrap optimizers: not nameable in YAML.
_NOT_SCHEDULES = ("inject_hyperparams", "inject_stateful_hyperparams", "join_schedules")


def _rank_at_least_2(params: Any) -> Any:
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


# ``optimizer.weight_decay_mask`` -> optax's ``mask=`` (a function of the parameters).
WEIGHT_DECAY_MASKS: dict[str, Callable[[Any], Any]] = {"ndim >= 2": _rank_at_least_2}
# How optax's optimizers name their weight-decay mask.
_MASK_PARAMS = ("mask", "weight_decay_mask")


def optimizer_by_name(
    name: str,
    learning_rate: float | optax.Schedule,
    kwargs: Mapping[str, Any],
    *,
    section: str = "optimizer",
) -> optax.GradientTransformation:
    """``getattr(optax, name)(learning_rate, **kwargs)``; errors name the config
    ``section`` it came from.

    Raises:
      ConfigError: no such optax optimizer (with the closest name), or arguments it
        does not take.
    """
    fn = getattr(optax, name, None)
    if not callable(fn):
        names = [n for n in dir(optax) if not n.startswith("_") and n.islower()]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"Config field '{section}.name': optax has no optimizer {name!r}.{hint} "
            "Examples: adam, adamw, sgd, rmsprop."
        )
    try:
        return cast(optax.GradientTransformation, fn(learning_rate, **kwargs))
    except TypeError as e:
        raise ConfigError(f"Config section '{section}': optax.{name}(...) failed: {e}.") from e


def schedule_names() -> list[str]:
    """The schedules ``optimizer.schedule.name`` may name (``optax.schedules``' functions)."""
    return sorted(
        n
        for n in dir(optax.schedules)
        if n.islower()
        and not n.startswith("_")
        and n not in _NOT_SCHEDULES
        and callable(getattr(optax.schedules, n))
    )


def build_schedule(cfg: ScheduleConfig, run_steps: int | None = None) -> optax.Schedule:
    """``getattr(optax.schedules, cfg.name)(**cfg.kwargs)``, checked.

    Args:
      cfg: the ``optimizer.schedule`` section.
      run_steps: the run's length in steps, if known: the schedule's values over it must
        be finite and >= 0, and not all 0.

    Raises:
      ConfigError: an unknown name (with the closest), keyword arguments the schedule
        does not take or that it refuses, a number written so that YAML reads a string
        (``1e-3``), or values that are not finite, are negative or are all 0.
    """
    names = schedule_names()
    if cfg.name not in names:
        close = difflib.get_close_matches(cfg.name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"Config field 'optimizer.schedule.name': optax has no schedule {cfg.name!r}.{hint} "
            f"Schedules: {', '.join(names)}."
        )
    fn = getattr(optax.schedules, cfg.name)
    for key, value in cfg.kwargs.items():
        if isinstance(value, str) and _is_number(value):
            raise ConfigError(
                f"Config field 'optimizer.schedule.kwargs.{key}' must be a number. Received: "
                f"{value!r} (str): YAML reads 1e-3 as a string; write 1.0e-3."
            )
    sig = inspect.signature(fn)
    try:
        sig.bind(**cfg.kwargs)
    except TypeError as e:
        raise ConfigError(
            f"Config field 'optimizer.schedule.kwargs' does not fit optax.schedules."
            f"{cfg.name}: {e}. Its signature: {cfg.name}({_parameters(sig)})."
        ) from e
    try:
        schedule = fn(**cfg.kwargs)
        values = jax.vmap(schedule)(jnp.arange(max(run_steps or 1, 1)))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"Config field 'optimizer.schedule': optax.schedules.{cfg.name}(**kwargs) failed: "
            f"{str(e).rstrip('.')}. Received: kwargs={cfg.kwargs!r}."
        ) from e
    values = np.asarray(values, np.float64)
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        raise ConfigError(
            f"Config field 'optimizer.schedule' must give learning rates that are finite and "
            f">= 0. Received: {float(values[bad[0]]):.6g} at step {int(bad[0])} from {cfg.name}"
            f"({_kwargs_text(cfg.kwargs)})."
        )
    if run_steps and not values.any():
        raise ConfigError(
            f"Config field 'optimizer.schedule': {cfg.name}({_kwargs_text(cfg.kwargs)}) is 0 at "
            f"every one of the run's {run_steps} steps, so training would change nothing. "
            "Give it a peak or initial value > 0."
        )
    return cast(optax.Schedule, schedule)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parameters(sig: inspect.Signature) -> str:
    """``a, b=1.0``: a signature's names and defaults, without its (long) annotations."""
    return ", ".join(
        p.name if p.default is p.empty else f"{p.name}={p.default!r}"
        for p in sig.parameters.values()
    )


def _kwargs_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _mask_param(name: str, kwargs: Mapping[str, Any]) -> str:
    """The keyword under which ``optax.<name>`` takes its weight-decay mask."""
    fn = getattr(optax, name)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    found = [p for p in _MASK_PARAMS if p in params]
    if not found:
        takers = []
        for n in dir(optax):
            f = getattr(optax, n)
            if n.islower() and not n.startswith("_") and callable(f):
                try:
                    ps = list(inspect.signature(f).parameters)
                except (TypeError, ValueError):
                    continue
                if ps[:1] == ["learning_rate"] and any(p in ps for p in _MASK_PARAMS):
                    takers.append(n)
        raise ConfigError(
            f"Config field 'optimizer.weight_decay_mask' needs an optimizer with weight decay "
            f"and a mask. Received: optimizer.name={name!r}, whose optax function takes no "
            f"{' or '.join(_MASK_PARAMS)}. Optimizers that do: {', '.join(sorted(takers))}; or "
            "set optimizer.weight_decay_mask=null."
        )
    if found[0] in kwargs:
        raise ConfigError(
            f"Config fields 'optimizer.weight_decay_mask' and 'optimizer.kwargs.{found[0]}' "
            "both set the weight-decay mask. Keep one of them."
        )
    return found[0]


def build_optimizer(
    cfg: OptimizerConfig, run_steps: int | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule | None]:
    """The optax optimizer of an ``optimizer`` section, and its schedule (or ``None``).

    ``getattr(optax, name)(schedule or learning_rate, **kwargs, mask=...)``, chained
    after ``optax.clip_by_global_norm(clip_global_norm)`` when that is set.

    Args:
      cfg: the section.
      run_steps: the run's length in steps, if known (checks the schedule over it).

    Raises:
      ConfigError: see :func:`optimizer_by_name`, :func:`build_schedule`; a
        ``weight_decay_mask`` for an optimizer without one; a schedule on an optimizer
        that keeps no step count for it (its value could not be logged).
    """
    schedule = build_schedule(cfg.schedule, run_steps) if cfg.schedule is not None else None
    kwargs = dict(cfg.kwargs)
    if cfg.weight_decay_mask is not None:
        kwargs[_mask_param(cfg.name, kwargs)] = WEIGHT_DECAY_MASKS[cfg.weight_decay_mask]
    rate = schedule if schedule is not None else cfg.learning_rate
    tx = optimizer_by_name(cfg.name, rate, kwargs)
    if schedule is not None:
        found = len(_schedule_states(jax.eval_shape(tx.init, {"w": jnp.zeros((2, 2))})))
        if found != 1:
            raise ConfigError(
                f"Config field 'optimizer.schedule': optax.{cfg.name} keeps {found} schedule "
                "step counts (optax.ScaleByScheduleState) in its state, not 1, so the "
                "learning rate it uses cannot be known. Use an optimizer that takes "
                "learning_rate as optax.adamw does, or no schedule."
            )
    if cfg.clip_global_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_global_norm), tx)
    return tx, schedule


def _schedule_states(opt_state: Any) -> list[optax.ScaleByScheduleState]:
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
    return [x for x in nodes if isinstance(x, optax.ScaleByScheduleState)]


def schedule_count(opt_state: Any) -> int:
    """The updates applied so far, as the schedule counts them (its ``count``).

    Raises:
      ValueError: ``opt_state`` holds no ``optax.ScaleByScheduleState`` or several.
    """
    found = _schedule_states(opt_state)
    if len(found) != 1:
        raise ValueError(
            "Expected an optimizer state with exactly one optax.ScaleByScheduleState (an "
            f"optimizer given a schedule as its learning rate). Received {len(found)}."
        )
    count = found[0].count
    if isinstance(count, jax.Array):
        count = count.addressable_data(0)  # replicated: every copy holds the count
    return int(np.asarray(jax.device_get(count)))


class LearningRateLogger(Callback):
    """Adds ``learning_rate`` to the logs: the rate the latest update used.

    At every host sync (``on_train_batch_end`` with logs) and epoch end, reads the
    optimizer's schedule count ``n`` from the state (``opt_state`` must hold one
    ``optax.ScaleByScheduleState``) and logs ``schedule(n - 1)``, the value the
    ``n``-th update used (``schedule(0)`` before any update). Put it before the
    loggers: they write the logs it extends.

    Args:
      schedule: the optimizer's schedule (``optax.Schedule``).
      state_fn: the optimizer state within the Trainer's state (default
        ``state.opt_state``).
    """

    def __init__(
        self, schedule: optax.Schedule, state_fn: Callable[[Any], Any] | None = None
    ) -> None:
        self.schedule = schedule
        self.state_fn = state_fn or (lambda state: state.opt_state)

    def value(self, state: Any) -> float:
        """The learning rate the latest update of ``state`` used."""
        n = schedule_count(self.state_fn(state))
        return float(self.schedule(max(n - 1, 0)))

    def on_train_batch_end(self, info: StepInfo) -> None:
        if info.logs is not None:
            info.logs["learning_rate"] = self.value(info.state)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is None:
            return
        if not isinstance(logs, dict):
            raise TypeError(
                "LearningRateLogger adds to the epoch's logs: expected the dict the Trainer "
                f"passes. Received: {type(logs).__name__}."
            )
        logs["learning_rate"] = self.value(self._fit_trainer.state)
