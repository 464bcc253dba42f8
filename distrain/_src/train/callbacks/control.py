"""Callbacks that decide when training stops: ``EarlyStopping`` and ``TerminateOnNaN``."""

from __future__ import annotations

import math
import warnings
from typing import Any

from distrain._src.train.callbacks.base import Callback, Logs, StepInfo

# Metric names whose larger values are better (Keras gives its metrics a direction;
# distrain's metrics are plain names, so `mode="auto"` reads the name).
_MAXIMIZED = ("acc", "auc", "precision", "recall", "f1", "fbeta", "iou", "r2_score")


def improved(value: float, reference: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``reference`` by more than ``min_delta`` in ``mode``
    (``"min"``/``"max"``); the first value (no reference) does unless it is NaN, and a NaN
    never does."""
    if reference is None:
        return not math.isnan(value)
    if mode == "min":
        return value < reference - min_delta
    return value > reference + min_delta


def resolve_mode(monitor: str | None, mode: str, who: str) -> str:
    """``"min"`` or ``"max"`` for ``mode``; ``"auto"`` is ``"max"`` for names containing
    ``acc``, ``auc``, ``precision``, ``recall``, ``f1``, ``fbeta``, ``iou`` or ``r2_score``.

    Raises:
      ValueError: ``mode`` is not ``"auto"``, ``"min"`` or ``"max"``.
    """
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"{who} mode must be 'auto', 'min' or 'max'. Received: mode={mode!r}.")
    if mode != "auto":
        return mode
    name = (monitor or "").removeprefix("val_")
    return "max" if any(k in name for k in _MAXIMIZED) else "min"


def validation_pending(monitor: str, logs: Logs, trainer: Any) -> bool:
    """Whether a ``val_`` ``monitor`` is absent only because this epoch did not validate
    (``validation_freq`` > 1): validation is configured and no ``val_`` metric is in the logs.
    A misspelled ``val_`` name on an epoch that did validate is not pending."""
    return (
        monitor.startswith("val_")
        and trainer is not None
        and bool(trainer.loop.has_validation)
        and not any(k.startswith("val_") for k in logs)
    )


class EarlyStopping(Callback):
    """Stops ``fit`` when a monitored metric has stopped improving (Keras semantics).

    Each monitored epoch counts one more epoch of waiting; an improvement over the best
    value resets the count (if it also beats ``baseline``), and training stops at the
    epoch where ``patience`` epochs have passed without one: with ``patience=2`` and
    losses ``[1.0, 0.9, 0.95, 0.96]`` it stops after epoch 3 (0-based), as Keras does.

    Args:
      monitor: the epoch metric to watch, e.g. ``"val_loss"`` or ``"accuracy"``.
      min_delta: smallest change that counts as an improvement.
      patience: epochs without improvement before stopping.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` for accuracy-like names, see
        ``resolve_mode``; else ``"min"``).
      baseline: a value the metric must beat; until then no epoch resets the count.
      restore_best_weights: at the end of ``fit`` (stopped by this callback, by another,
        or after the last epoch), make the state of the best epoch the result of
        ``fit``; the first monitored epoch's state counts as best until one improves.
      start_from_epoch: epochs to wait before watching at all (warm-up).

    Raises:
      ValueError: a bad ``mode``; at an epoch end, a ``monitor`` that is not among the
        metrics (the message lists them).

    Example:
      >>> dt.callbacks.EarlyStopping("val_loss", patience=3, restore_best_weights=True)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        *,
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode, "EarlyStopping")
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.stopped_epoch: int | None = None
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.best_state: Any = None
        self.wait = 0

    def _improved(self, value: float, reference: float | None) -> bool:
        return improved(value, reference, self.mode, self.min_delta)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.wait = 0
        self.best = None
        self.best_epoch = None
        self.best_state = None
        self.stopped_epoch = None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = dict(logs or {})
        if self.monitor not in logs:
            if validation_pending(self.monitor, logs, self.trainer):
                return  # no validation this epoch (validation_freq > 1)
            raise ValueError(
                f"EarlyStopping monitors {self.monitor!r}, which is not among the epoch "
                f"metrics: {', '.join(sorted(logs)) or '(none)'}. Pass one of them as `monitor`"
                + (
                    " (val_ metrics need validation_data)."
                    if self.monitor.startswith("val_")
                    else "."
                )
            )
        value = float(logs[self.monitor])
        if epoch < self.start_from_epoch:
            return
        t = self.trainer
        self.wait += 1
        if self._improved(value, self.best):  # a NaN never improves
            self.best, self.best_epoch = value, epoch
            if self.restore_best_weights and t is not None:
                self.best_state = t.state_snapshot()
            if self.baseline is None or self._improved(value, self.baseline):
                self.wait = 0
            return
        if self.restore_best_weights and self.best_state is None and t is not None:
            # Until an epoch improves, the first monitored one is the best (Keras).
            self.best_state, self.best_epoch = t.state_snapshot(), epoch
        if self.wait >= self.patience and epoch > 0 and t is not None:
            self.stopped_epoch = epoch
            t.stop_training = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.restore_best_weights and self.best_state is not None and self.trainer is not None:
            self.trainer.state = self.best_state


class TerminateOnNaN(Callback):
    """Stops ``fit`` as soon as a metric is NaN or infinite (like Keras' callback).

    By default the stop is graceful, as in Keras: ``fit`` ends after the current step
    and returns (the epoch's metrics, NaN included, are in the history), with a
    ``RuntimeWarning`` naming the metric and the step, and saying that distrain before
    0.2 raised instead (``CHANGELOG.md``). With ``raise_error=True`` it raises
    ``RuntimeError`` instead, and the other callbacks' ``on_train_end`` is not called
    (they get ``on_train_abort``).

    Every metric is checked, not only ``loss``, whenever the Trainer syncs with the host
    (every ``log_every`` steps and at epoch ends); use ``log_every=1`` to check every
    step. Checkpoint callbacks never save a non-finite state, so the last good
    checkpoint stays the newest one.

    Args:
      raise_error: raise ``RuntimeError`` instead of stopping gracefully.

    Example:
      >>> dt.callbacks.TerminateOnNaN(raise_error=True)
    """

    def __init__(self, raise_error: bool = False) -> None:
        self.raise_error = raise_error
        self._stopped = False

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._stopped = False

    def _check(self, logs: Logs | None, step: int, epoch: int) -> None:
        t = self.trainer
        if self._stopped:
            return  # already stopping (said so once)
        for name, value in (logs or {}).items():
            try:
                finite = math.isfinite(float(value))
            except (TypeError, ValueError):
                continue
            if finite:
                continue
            message = (
                f"TerminateOnNaN: metric {name!r} is {float(value)} at step {step} "
                f"(epoch {epoch}). Expected finite metrics; training stopped and no "
                "checkpoint holds a non-finite state. Lower the learning rate or check the "
                "data."
            )
            if self.raise_error:
                raise RuntimeError(message)
            # Until cf2e411 this callback raised; say so to code written for that.
            warnings.warn(
                f"{message} fit returns normally (as Keras's TerminateOnNaN); distrain "
                "before 0.2 raised RuntimeError here: pass TerminateOnNaN(raise_error=True) "
                "for that.",
                RuntimeWarning,
                stacklevel=2,
            )
            self._stopped = True
            if t is not None:
                t.stop_training = True
            return

    def on_train_batch_end(self, info: StepInfo) -> None:
        if info.logs:
            self._check(info.logs, info.step, info.epoch)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        step = self.trainer.loop.global_step if self.trainer is not None else -1
        self._check(logs, step, epoch)
