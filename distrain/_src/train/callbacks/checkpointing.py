"""Checkpoint callbacks: ``ModelCheckpoint`` (keep checkpoints) and ``BackupAndRestore``
(resume a run exactly after any failure).

Both save, as one atomic orbax step (``dt.checkpoint.CheckpointManager``), the train state, the
training input's position and the Trainer's progress (epoch, step, history and the
metric sums of the unfinished epoch). A run restored from such a checkpoint draws the
same batches and reaches bit-identical parameters on the same devices.

Both act on every process (saving is collective with several processes), never save a
state that holds NaN or infinity (the last good checkpoint stays the newest), check at
``fit`` start that their directory can be written, and mark a completed ``fit``
(``finish_mark``: where a ``dt.SidecarEvaluator`` stops).

Example:
  >>> callbacks = [dt.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)]
  >>> state, history = trainer.fit(state, data, epochs=10, callbacks=callbacks)
  >>> # Killed at any point? Run the same command again: it continues where it stopped.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distrain._src.goodput import ledger as goodput
from distrain._src.goodput.ledger import settle_steps
from distrain._src.train.callbacks import finish_mark
from distrain._src.train.callbacks.base import Callback, Logs, StepInfo, ensure_writable_dir
from distrain._src.train.callbacks.control import improved, resolve_mode, validation_pending
from distrain._src.train.state import checkpoint_metadata, checkpointed, restored_over
from distrain._src.validate import is_positive_int


def _check_freq(save_freq: Any, who: str) -> int | str:
    if save_freq == "epoch":
        return "epoch"
    if not is_positive_int(save_freq):
        raise ValueError(
            f"{who} save_freq must be 'epoch' or a positive number of steps. "
            f"Received: save_freq={save_freq!r}."
        )
    return int(save_freq)


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    ok = jnp.bool_(True)
    for x in leaves:
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def state_is_finite(state: Any) -> bool:
    """Whether every floating-point leaf of ``state`` is free of NaN and infinity."""
    from distrain._src.values import PerReplica

    leaves = [
        x.value if isinstance(x, PerReplica) else x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, PerReplica))
    ]
    leaves = [
        x
        for x in jax.tree.leaves(leaves)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return bool(np.asarray(_all_finite(leaves))) if leaves else True


class _Saver(Callback):
    """What both checkpoint callbacks share: a manager, step/epoch save triggers."""

    _who = "checkpoint"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        save_freq: int | str,
        max_to_keep: int | None,
        async_save: bool,
    ) -> None:
        from distrain._src.checkpoint._directory import check_directory_arg

        self.directory = check_directory_arg(directory, type(self).__name__)
        self.save_freq = _check_freq(save_freq, type(self).__name__)
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self.manager: Any = None
        self.last_saved_step: int | None = None
        self._offset: int | None = None  # checkpoint number - trainer step, fixed per fit
        self._local: dict[str, Any] = {}  # the manager's local tier arguments

    def _open(self) -> None:
        from distrain._src.checkpoint.manager import CheckpointManager

        ensure_writable_dir(self.directory, f"{type(self).__name__} checkpoint")
        self.manager = CheckpointManager(
            self.directory, max_to_keep=self.max_to_keep, async_save=self.async_save, **self._local
        )
        self._offset = None
        if self._fit_trainer.is_chief:  # this fit writes here: not finished any more
            finish_mark.clear(self.directory)

    def checkpoint_step(self) -> int:
        """The number the current state is saved under.

        The trainer's step, unless the directory already holds newer checkpoints
        than the step this ``fit`` started from (a second ``fit`` of a restored model,
        Keras' make-or-restore pattern, starts counting at 0 again): then the
        numbering continues after the newest checkpoint, so every save is written and
        the newest checkpoint is always the newest state.
        """
        t = self._fit_trainer
        if self._offset is None:  # decided at the first save, after any resume
            latest = self.manager.latest_step()
            self._offset = 0 if latest is None else max(0, latest - t.loop.initial_step)
        return t.loop.global_step + self._offset

    def _save(self, local: bool = False) -> bool:
        """Saves the trainer's state and position now (all processes call it together),
        to the local tier with ``local``."""
        t = self.trainer
        if t is None or self.manager is None:
            return False
        if not state_is_finite(t.state):
            warnings.warn(
                f"{type(self).__name__}: not saving step {t.loop.global_step} because the state "
                f"holds NaN or infinity; the newest checkpoint in {self.directory} stays "
                f"step {self.manager.latest_step()}.",
                stacklevel=2,
            )
            return False
        step = self.checkpoint_step()
        settle_steps(t.state)
        with goodput.phase("checkpoint"):
            meta = {"progress": t.progress(), **checkpoint_metadata(t.state)}
            # The local tier copies to the host before it returns; the asynchronous write
            # must not read what the next step donates: a copy (of what is saved only).
            state, data = checkpointed(t.state, copy=not local), t.data_state()
            if local:
                saved = self.manager.save_local(step, state, data_state=data, metadata=meta)
            else:
                saved = self.manager.save(step, state, data_state=data, metadata=meta, force=True)
        if saved:
            self.last_saved_step = step
            ledger = goodput.current()
            if ledger is not None:
                ledger.saved(t.loop.global_step)
        return bool(saved)

    def _crossed(self, info: StepInfo, freq: int | str | None = None) -> bool:
        f = self.save_freq if freq is None else freq
        return isinstance(f, int) and info.step // f > (info.step - info.num_steps) // f

    def _finish(self, mark: bool = False) -> None:
        """Closes the manager; ``mark``: then marks the training finished (``finish_mark``)."""
        latest = None
        if self.manager is not None:
            with goodput.phase("checkpoint"):
                self.manager.wait_until_finished()  # the final save is committed first
                latest = self.manager.latest_step()
                self.manager.close()
            self.manager = None
        if mark and (self.trainer is None or self.trainer.is_chief):
            finish_mark.write(self.directory, latest)

    def on_train_abort(self, error: BaseException) -> None:
        self._finish()  # a save in progress completes: it is the last good checkpoint


class ModelCheckpoint(_Saver):
    """Saves checkpoints during ``fit`` (like ``keras.callbacks.ModelCheckpoint``).

    Restore one with ``dt.checkpoint.CheckpointManager(directory).restore(target=state)``; its
    ``metadata["progress"]`` holds the epoch, step and history.

    Checkpoints are numbered by the trainer's step. When ``directory`` already holds
    newer ones (a second ``fit`` of a restored model starts counting at 0 again, as in
    Keras' make-or-restore pattern), the numbering continues after the newest
    checkpoint, so every save is written and the newest checkpoint is the newest state.

    Args:
      directory: the checkpoint directory (one subdirectory per step).
      save_freq: ``"epoch"`` or a number of steps.
      max_to_keep: newest checkpoints kept (``None``: all).
      monitor: with ``save_best_only``, the epoch metric to compare (e.g. ``"val_loss"``).
        At an epoch end without it, it warns (naming the metrics there are) and saves,
        as Keras does, so a misspelled name cannot disable every checkpoint silently.
      mode: ``"min"``, ``"max"`` or ``"auto"`` (``max`` for accuracy-like names, as in
        ``EarlyStopping``).
      save_best_only: save an epoch only if ``monitor`` improved.
      initial_value_threshold: with ``save_best_only``, the value the first saved epoch
        must beat (Keras' argument); ``None``: the first epoch is saved.
      async_save: write in the background (the loop continues meanwhile).

    Raises:
      ValueError: bad ``save_freq``/``mode``, or ``save_best_only`` without ``monitor``
        or with a step ``save_freq``.
      OSError: at ``fit`` start, if ``directory`` cannot be written.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save_freq: int | str = "epoch",
        max_to_keep: int | None = 3,
        monitor: str | None = None,
        mode: str = "auto",
        save_best_only: bool = False,
        initial_value_threshold: float | None = None,
        async_save: bool = True,
    ) -> None:
        super().__init__(directory, save_freq, max_to_keep, async_save)
        mode = resolve_mode(monitor, mode, "ModelCheckpoint")
        if save_best_only and (monitor is None or self.save_freq != "epoch"):
            raise ValueError(
                "ModelCheckpoint(save_best_only=True) compares an epoch metric: it needs "
                f"monitor=<metric> and save_freq='epoch'. Received: monitor={monitor!r}, "
                f"save_freq={self.save_freq!r}."
            )
        self.monitor, self.mode, self.save_best_only = monitor, mode, save_best_only
        self.initial_value_threshold = initial_value_threshold
        self.best: float | None = initial_value_threshold

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._open()
        self.best = self.initial_value_threshold

    def on_train_batch_end(self, info: StepInfo) -> None:
        if self._crossed(info):
            self._save()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq != "epoch":
            return
        if self.save_best_only and self.monitor is not None:  # set: checked in __init__
            logs = dict(logs or {})
            value = logs.get(self.monitor)
            if value is None:
                if validation_pending(self.monitor, logs, self.trainer):
                    return  # no validation this epoch (validation_freq > 1)
                warnings.warn(
                    f"ModelCheckpoint(save_best_only=True) monitors {self.monitor!r}, which is "
                    f"not among the epoch metrics: {', '.join(sorted(logs)) or '(none)'}. "
                    "Saving this epoch anyway (as Keras does); pass one of them as `monitor`.",
                    stacklevel=2,
                )
                self._save()
                return
            if not improved(float(value), self.best, self.mode):
                return
            self.best = float(value)
        self._save()

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._finish(mark=True)


class BackupAndRestore(_Saver):
    """Backs up the run and, at the start of ``fit``, resumes from the latest backup.

    Unlike TensorFlow's, the resumed run does not redo the unfinished epoch: the input
    position, the step inside the epoch and the epoch's metric sums are restored, so
    the run continues with the next batch and ends with bit-identical parameters (on
    the same devices; see ``docs/fault_tolerance.md``).

    Its ``on_train_begin`` runs before every other callback's (``restores_progress``), so
    loggers anywhere in the list see the resumed step and keep the killed run's lines.

    On SIGTERM (preemption) it finishes the current step, saves, and exits with
    ``dt.checkpoint.PREEMPTION_EXIT_CODE`` (143); run the same command to continue. If the
    state holds NaN or infinity then, nothing is saved and ``fit`` raises
    ``FloatingPointError`` (exit status 1) instead.

    For Keras' make-or-restore pattern (each run trains more, starting from the last
    model) use ``ModelCheckpoint`` and restore its newest checkpoint before ``fit``.

    Args:
      backup_dir: where backups live; give each run its own.
      save_freq: ``"epoch"`` or a number of steps between backups.
      max_to_keep: backups kept (at least 2, so a damaged newest one has a fallback).
      delete_checkpoint: delete ``backup_dir`` (backups and any damaged step set aside
        in it) and the local tier when ``fit`` completes with a finite state, as Keras
        does, so the next run of the command starts afresh. With False, the finished
        state is backed up too: running the same ``fit`` again restores it and trains
        nothing more (a larger ``epochs`` continues from it); call
        :meth:`delete_backups` once the work that follows ``fit`` (a final evaluation,
        an export) is done, as ``distrain train`` does. A state holding NaN or infinity
        at the end never deletes the backups: the newest is the last good state.
      async_save: write in the background.
      handle_preemption: install the SIGTERM handler (main thread only).
      verbose: print one line (chief only) when ``fit`` resumes from a backup and when a
        SIGTERM stops it, saying which step and where.
      local_directory: a fast local tier (node-local, e.g. ``/dev/shm/<run>``): a backup
        every ``local_save_freq`` steps goes there (each process's shards, mirrored on
        a peer process), the persistent ``backup_dir`` every ``save_freq``. ``fit``
        resumes from the newest backup that verifies in either tier. See
        ``dt.checkpoint.CheckpointManager`` and ``docs/fault_tolerance.md``.
      local_save_freq: steps between local backups (required with ``local_directory``).

    Raises:
      ValueError: bad ``save_freq`` or local tier arguments (a ``local_directory`` inside
        ``backup_dir``, ``local_save_freq`` < 1 or without ``local_directory``); at
        ``fit`` start, a backup from a different model (the message names the first
        mismatching leaf and both shapes) or a local directory that cannot be written.
      OSError: at ``fit`` start, if ``backup_dir`` cannot be written.

    Example:
      >>> dt.callbacks.BackupAndRestore("gs://bucket/run/backup", save_freq=500,
      ...                               local_directory="/dev/shm/run", local_save_freq=10)
    """

    restores_progress = True

    def __init__(
        self,
        backup_dir: str | os.PathLike[str],
        *,
        save_freq: int | str = "epoch",
        max_to_keep: int = 2,
        delete_checkpoint: bool = True,
        async_save: bool = True,
        handle_preemption: bool = True,
        verbose: bool = True,
        local_directory: str | os.PathLike[str] | None = None,
        local_save_freq: int | None = None,
    ) -> None:
        super().__init__(backup_dir, save_freq, max_to_keep, async_save)
        if local_directory is not None or local_save_freq is not None:
            from distrain._src.checkpoint.local import check_arguments

            check_arguments(self.directory, local_directory, local_save_freq, "local_save_freq")
            self._local = {
                "local_directory": local_directory,
                "local_save_interval_steps": local_save_freq,
            }
        self.local_save_freq = local_save_freq
        self.delete_checkpoint = delete_checkpoint
        self.handle_preemption = handle_preemption
        self.verbose = verbose
        self.restored_step: int | None = None
        self._preemption: Any = None
        self._calls = 0
        self._fit_manager: Any = None  # the last fit's manager, closed: its local tier
        self._ended_finite = True

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._open()
        self._fit_manager = self.manager
        self.restored_step = self.last_saved_step = None
        self._calls = 0
        self._ended_finite = False  # until this fit ends finite: an aborted fit keeps its backups
        t = self._fit_trainer
        began = time.perf_counter()
        restored = self.manager.restore(target=checkpointed(t.state))  # no frozen base
        if restored is not None:
            goodput.note_restore(
                source=self.manager.restored_from, seconds=time.perf_counter() - began
            )
            progress = (restored.metadata or {}).get("progress")
            if progress is None:
                raise ValueError(
                    f"The checkpoint at step {restored.step} in {self.directory} was not "
                    "written by BackupAndRestore (it has no trainer progress). Use an empty "
                    "backup_dir for each run."
                )
            t.resume(
                restored_over(t.state, restored, self.directory), progress, restored.data_state
            )
            self.restored_step = restored.step
            loop = t.loop
            where = {
                "local": "the local tier",
                "peer": "the local tier (some processes' copies from their peers)",
            }.get(self.manager.restored_from, str(self.directory))
            if loop.finished():  # kept by delete_checkpoint=False; killed after fit ended
                self._say(
                    f"BackupAndRestore: training had finished: the backup of step "
                    f"{loop.global_step} in {where} is its final state, so nothing is left "
                    "to train"
                )
            else:
                self._say(
                    f"BackupAndRestore: resumed from the backup of step {loop.global_step} "
                    f"(epoch {loop.epoch + 1}, {loop.step_in_epoch} steps into it) in {where}"
                )
        if self.handle_preemption and threading.current_thread() is threading.main_thread():
            from distrain._src.checkpoint.preemption import PreemptionHandler

            self._preemption = PreemptionHandler()

    def on_train_batch_end(self, info: StepInfo) -> None:
        self._calls += 1
        if self._preemption is not None and self._preemption.should_stop(self._calls):
            finite = state_is_finite(self._fit_trainer.state)
            self._save()
            latest = self.manager.latest_step()
            self._finish()
            if not finite:
                # 143 means "saved, run again to continue": not true here.
                self._close_preemption()
                raise FloatingPointError(
                    f"BackupAndRestore: preempted at step {self._fit_trainer.loop.global_step}, "
                    "but the state holds NaN or infinity, so it was not saved; the newest backup "
                    f"in {self.directory} is step {latest}, the last good state. Fix the cause "
                    "(e.g. lower the learning rate) before resuming from it."
                )
            self._say(
                f"BackupAndRestore: stopped by SIGTERM after step {latest}, saved in "
                f"{self.directory}; exit status {self._preemption.exit_code}: run the same "
                "command to continue from it"
            )
            self._close_preemption(exit_after=True)
        if self._crossed(info):
            self._save()
        elif self.local_save_freq and self._crossed(info, self.local_save_freq):
            self._save(local=True)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save()

    def on_train_end(self, logs: Logs | None = None) -> None:
        t = self.trainer
        finite = self._ended_finite = t is None or state_is_finite(t.state)
        if finite and not self.delete_checkpoint:
            # Back up the finished state: running the same fit again restores it and
            # has nothing left to train, instead of redoing the steps after the last save.
            self._save()
        latest = self.manager.latest_step() if self.manager is not None else None
        self._finish(mark=finite and not self.delete_checkpoint)  # the finished state is kept
        self._close_preemption()
        if not finite:
            warnings.warn(
                f"BackupAndRestore: fit ended with NaN or infinity in the state, so the "
                f"backups in {self.directory} are kept (not deleted): the newest, step "
                f"{latest}, is the last good state. Fix the cause (e.g. lower the learning "
                "rate) and resume from it.",
                stacklevel=2,
            )
            return
        if self.delete_checkpoint:
            self.delete_backups()

    def delete_backups(self) -> None:
        """Deletes the backups: the chief deletes ``backup_dir``, every process its part of
        the local tier. Call it on every process after ``fit`` returned.

        What a completed ``fit`` does itself with ``delete_checkpoint=True``. With False,
        call it once the work that follows ``fit`` is done (a final evaluation, an
        export): a failure during that work then resumes from the finished state instead
        of training again. After a ``fit`` that ended with NaN or infinity in the state
        it deletes nothing (the newest backup is the last good state).

        Raises:
          RuntimeError: during ``fit`` (a save may be in flight).
        """
        if self.manager is not None:
            raise RuntimeError(
                "BackupAndRestore.delete_backups() deletes the backups once fit has "
                f"returned, but it was called during fit (backups in {self.directory} are "
                "being written). Call it after fit, on every process; or let fit delete "
                "them when it completes with delete_checkpoint=True."
            )
        if not self._ended_finite:
            return
        if self._fit_manager is not None:
            self._fit_manager.delete_local()  # every process its own part
        if self.trainer is None or self.trainer.is_chief:
            shutil.rmtree(self.directory, ignore_errors=True)

    def on_train_abort(self, error: BaseException) -> None:
        super().on_train_abort(error)
        self._close_preemption()

    @property
    def newest_backup(self) -> int | None:
        """The newest backup this ``fit`` wrote or resumed from (None: none yet)."""
        return self.last_saved_step if self.last_saved_step is not None else self.restored_step

    def _say(self, line: str) -> None:
        if self.verbose and (self.trainer is None or self.trainer.is_chief):
            print(line, flush=True)

    def _close_preemption(self, exit_after: bool = False) -> None:
        handler, self._preemption = self._preemption, None
        if handler is None:
            return
        handler.close()
        if exit_after:
            handler.exit()
