"""Callbacks that decide when training stops: ``EarlyStopping`` and ``TerminateOnNaN``."""

from __future__ import annotations

import math
from typing import Any

from distrain._src.train.callbacks.base import Callback, Logs, StepInfo


class EarlyStopping(Callback):
    """Stops ``fit`` when a monitored metric has stopped improving.

    Args:
      monitor: the epoch metric to watch, e.g. ``"val_loss"`` or ``"accuracy"``.
      min_delta: smallest change that counts as an improvement.
      patience: epochs without improvement before stopping.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` for names containing
        ``acc``/``auc``/``precision``/``recall``, else ``"min"``).
      baseline: a value the metric must beat; until then epochs count as no improvement.
      restore_best_weights: when stopping, make the best epoch's state the result of ``fit``.
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
        if mode not in ("auto", "min", "max"):
            raise ValueError(
                f"EarlyStopping mode must be 'auto', 'min' or 'max'. Received: mode={mode!r}."
            )
        if mode == "auto":
            maximize = any(k in monitor for k in ("acc", "auc", "precision", "recall"))
            mode = "max" if maximize else "min"
        self.monitor = monitor
        self.mode = mode
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

    def _improved(self, value: float, reference: float) -> bool:
        if self.mode == "min":
            return value < reference - self.min_delta
        return value > reference + self.min_delta

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.wait = 0
        self.best = None
        self.best_epoch = None
        self.best_state = None
        self.stopped_epoch = None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = dict(logs or {})
        if self.monitor not in logs:
            validating_later = (
                self.monitor.startswith("val_")
                and self.trainer is not None
                and (self.trainer.has_validation)
            )
            if validating_later:
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
        if epoch < self.start_from_epoch or math.isnan(value):
            return
        if self.best is None or self._improved(value, self.best):
            baseline_ok = self.baseline is None or self._improved(value, self.baseline)
            self.best, self.best_epoch = value, epoch
            if self.restore_best_weights and self.trainer is not None:
                # Arrays are immutable and the Trainer never donates state: a reference is a copy.
                self.best_state = self.trainer.state_snapshot()
            if baseline_ok:
                self.wait = 0
                return
        self.wait += 1
        if self.wait > self.patience and self.trainer is not None:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True
            if self.restore_best_weights and self.best_state is not None:
                self.trainer.state = self.best_state


class TerminateOnNaN(Callback):
    """Stops ``fit`` with ``FloatingPointError`` as soon as a metric is NaN or infinite.

    Metrics are checked whenever the Trainer syncs with the host (every ``log_every``
    steps and at epoch ends); use ``log_every=1`` to check every step. Checkpoint
    callbacks never save a non-finite state, so the last good checkpoint stays the
    newest one.
    """

    def _check(self, logs: Logs | None, step: int, epoch: int) -> None:
        for name, value in (logs or {}).items():
            try:
                finite = math.isfinite(float(value))
            except (TypeError, ValueError):
                continue
            if not finite:
                raise FloatingPointError(
                    f"TerminateOnNaN: metric {name!r} is {float(value)} at step {step} "
                    f"(epoch {epoch}). Expected finite metrics; training stopped and nothing "
                    "was saved after the last finite check. Lower the learning rate or check "
                    "the data."
                )

    def on_train_batch_end(self, info: StepInfo) -> None:
        if info.logs:
            self._check(info.logs, info.step, info.epoch)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        step = self.trainer.global_step if self.trainer is not None else -1
        self._check(logs, step, epoch)
