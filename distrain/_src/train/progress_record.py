"""The progress record a checkpoint stores for ``Trainer.fit``, and resuming from it.

``Trainer.progress()`` writes it: the loop's position (epoch, step in the epoch, global
step), the history, the epoch's metric sums so far (read from the devices first) and
each callback's ``state_dict()``. ``Trainer.resume()`` reads it back into the loop, from
``on_train_begin`` of a callback with ``restores_progress = True``.

Example:
  >>> record = progress_record(trainer.loop, steps, epoch_done=False, callbacks=cbs)
  >>> epoch_sums = restore_loop(trainer.loop, record)
"""

from __future__ import annotations

import warnings
from typing import Any

from distrain._src.train._steps import Steps
from distrain._src.train.callbacks.base import CallbackList
from distrain._src.train.history import History
from distrain._src.train.progress import LoopState

__all__ = ["progress_record", "restore_loop", "warn_unless_resuming_callback"]


def progress_record(
    loop: LoopState, steps: Steps | None, epoch_done: bool, callbacks: CallbackList | None
) -> dict[str, Any]:
    """The loop position as JSON-compatible data (reads the metric window first)."""
    sums = None
    if steps is not None:
        steps.flush(loop.global_step)
        sums = None if epoch_done else steps.epoch_sums_json()
    return {
        "epoch": loop.epoch + 1 if epoch_done else loop.epoch,
        "step_in_epoch": 0 if epoch_done else loop.step_in_epoch,
        "global_step": loop.global_step,
        "history": loop.history.to_dict(),
        "epoch_sums": sums,
        "callbacks": callbacks.state_dicts() if callbacks is not None else {},
    }


def restore_loop(loop: LoopState, progress: dict[str, Any]) -> Any:
    """Sets ``loop``'s position and history from ``progress`` (a
    :func:`progress_record`); returns the epoch's metric sums so far (None: none)."""
    loop.epoch = loop.initial_epoch = int(progress["epoch"])
    loop.global_step = loop.initial_step = int(progress["global_step"])
    loop.step_in_epoch = int(progress.get("step_in_epoch", 0))
    loop.history = History.from_dict(progress.get("history") or {})
    return progress.get("epoch_sums")


def warn_unless_resuming_callback(callbacks: CallbackList) -> None:
    """Warns (``DeprecationWarning``, at ``Trainer.resume``'s caller) unless the resume
    comes from ``on_train_begin`` of a callback with ``restores_progress = True``."""
    if not callbacks.accepts_resume:
        # Deprecated for a release, then an error: the callbacks that began before
        # this one saw step 0 (a logger among them overwrote the resumed run's logs).
        warnings.warn(
            "`Trainer.resume` was called outside the on_train_begin of a callback that "
            "sets `restores_progress = True`; this will be an error in the next release. "
            "Set that class attribute on the callback that resumes: its on_train_begin "
            "then runs before the others', so loggers see the resumed step instead of "
            "overwriting the logs of the run being resumed.",
            DeprecationWarning,
            stacklevel=3,
        )
