"""``Goodput``: the callback that keeps a run's goodput ledger (``dt.goodput``)."""

from __future__ import annotations

import os

from distrain._src.goodput import ledger as goodput
from distrain._src.train.callbacks.base import Callback, Logs, StepInfo, ensure_writable_dir


class Goodput(Callback):
    """Records where the run's wall time goes in ``workdir/goodput.jsonl``.

    While ``fit`` runs, the Trainer charges its time to steps, input, checkpoints and
    evaluation; compilation and start-up are measured too, and a resumed run marks the
    step it continues from, so ``distrain goodput WORKDIR`` (``dt.goodput.report``) can
    account for every second across restarts, lost work and downtime included. Only
    the chief writes. A run that starts afresh in a directory whose ledger finished
    moves the old ledger aside (``goodput-<time>.jsonl``).

    The run is finished (a later attempt that starts afresh is a new run, and the
    report counts no failure for it) when ``fit`` ends, or, with ``finish_with_fit=False``,
    when the program calls ``callback.ledger.finished()`` after the work that follows
    ``fit`` (a final evaluation, an export): a kill during that work is then a failure
    the report counts. Wrap that work in ``callback.ledger.phase(...)`` to charge it
    to its bucket (``"evaluation"`` for an ``evaluate``; else it is ``other``).

    Args:
      workdir: the run's directory (e.g. the logging directory).
      interval: seconds between progress records (what a SIGKILL can lose).
      finish_with_fit: the end of ``fit`` finishes the run (False: the program says when,
        as ``distrain train`` does after its final evaluation).

    Raises:
      OSError: at ``fit`` start if ``workdir`` cannot be written.

    Example:
      >>> trainer = dt.Trainer(strategy, train_step, callbacks=[
      ...     dt.callbacks.Goodput("runs/exp"), dt.callbacks.BackupAndRestore("runs/exp/backup")])
      >>> print(dt.goodput.report("runs/exp").table())
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        interval: float = 1.0,
        finish_with_fit: bool = True,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"Goodput interval must be > 0 seconds. Received: {interval!r}.")
        self.workdir = os.fspath(workdir)
        self.interval = float(interval)
        self.finish_with_fit = finish_with_fit
        self.ledger: goodput.Ledger | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        t = self._fit_trainer
        if t.is_chief:
            ensure_writable_dir(self.workdir, "Goodput ledger")
            if t.loop.initial_step == 0:
                goodput.rotate_finished(self.workdir)
        self.ledger = goodput.Ledger(self.workdir, write=t.is_chief, interval=self.interval)
        if t.loop.initial_step:  # BackupAndRestore resumed before this ran
            self.ledger.resumed(t.loop.initial_step)
        else:
            goodput.note_restore()  # nothing of an earlier fit's restore carries over
        goodput.set_current(self.ledger)

    def on_train_batch_end(self, info: StepInfo) -> None:
        if self.ledger is not None:
            self.ledger.progress(info.step)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.ledger is None:
            return
        if self.finish_with_fit:
            self.ledger.finished()
        else:  # the totals at the end of training; the program finishes the run later
            self.ledger.record("train_end")
