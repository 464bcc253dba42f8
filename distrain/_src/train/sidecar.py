"""``dt.SidecarEvaluator``: evaluates the checkpoints a training job writes, beside it.

TensorFlow's ``tf.keras.utils.SidecarEvaluator`` for distrain: a separate job (the
cluster's "evaluator" task) that follows a checkpoint directory, restores each new
checkpoint onto its own strategy (any device count: the restore reshards) and runs
``eval_step`` over ``data`` with ``Trainer.evaluate``, so evaluation never stops the
workers and can use other hardware.

Separation of concerns: the training job writes checkpoints and, when ``fit``
completes, the finish mark (``callbacks/finish_mark.py``); ``CheckpointManager(...,
read_only=True)`` lists only committed steps and restores them without touching the
directory; this module picks the step, evaluates it, hands the metrics to the callbacks
and keeps its own progress file (``workdir/sidecar.json``), written after the callbacks,
so each checkpoint's result is recorded once across restarts. The callbacks see a
``fit``-like run: ``on_train_begin``, one ``on_epoch_end`` per checkpoint with the
metrics under ``eval/`` and ``trainer.loop.global_step`` set to the checkpoint's step
(the loggers' x axis), ``on_train_end``; after a restart ``loop.initial_epoch`` counts
the recorded evaluations and the loggers drop what a killed attempt wrote past them.

With several evaluator processes (their own ``jax.distributed`` world, never the
workers'), process 0 picks the step and every process evaluates that one.

Example:
  >>> sidecar = dt.SidecarEvaluator(eval_step, test_data, "/ckpt/run-42", state=state,
  ...                               callbacks=[dt.callbacks.TensorBoard("runs/42/eval")])
  >>> history = sidecar.start()    # returns once the final checkpoint is evaluated
  >>> history.history["eval/accuracy"]
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from distrain._src.checkpoint._directory import check_directory_arg
from distrain._src.checkpoint._layout import CheckpointCorruptionError
from distrain._src.goodput import ledger as goodput
from distrain._src.train.callbacks import finish_mark
from distrain._src.train.callbacks.base import Callback, CallbackList
from distrain._src.train.history import History
from distrain._src.train.trainer import Trainer
from distrain._src.validate import optional_positive_int

__all__ = ["SidecarEvaluator"]

PROGRESS_FILE = "sidecar.json"
_FORMAT = "distrain.sidecar/1"
# What process 0 tells the others each poll: evaluate a step, wait, or stop (and why).
_WAIT, _EVALUATE, _FINISHED, _MAX, _SIGNAL, _GONE = range(6)


class SidecarEvaluator:
    """Evaluates each checkpoint a training job writes to ``checkpoint_dir``, as it comes.

    Args:
      eval_step: ``eval_step(state, batch) -> metrics`` (per replica), as ``Trainer``'s.
      data: the evaluation data: an iterable of global batches (``dt.data.ArrayPipeline``
        with ``num_epochs=1``), read once per checkpoint.
      checkpoint_dir: the directory the training job writes (``ModelCheckpoint``,
        ``BackupAndRestore(delete_checkpoint=False)`` or a ``CheckpointManager``).
      strategy: where to evaluate (default ``dt.get_strategy()``): any device count.
      state: a template of the saved state (a ``TrainState``, or its
        ``jax.ShapeDtypeStruct`` tree from ``jax.eval_shape``): structure, shapes and
        dtypes; it is placed with ``strategy.put_replicated`` and each checkpoint is
        restored onto it.
      steps: batches per evaluation (default: the whole of ``data``).
      max_evaluations: stop after this many evaluations (counted across restarts).
      callbacks: ``dt.callbacks`` loggers (``TensorBoard``, ``CSVLogger``,
        ``JSONLinesLogger``, ``WandbLogger``, ``MLflowLogger``): metrics as ``eval/<name>``
        at each checkpoint's step. A tracker's run id saved in the checkpoint is loaded
        first, so MLflow logs into the training's run.
      every_checkpoint: evaluate every checkpoint, oldest first (default: the newest one
        at each look, skipping those it missed, as TensorFlow does).
      timeout: seconds to wait for the first checkpoint (None: no limit).
      poll_interval: seconds between looks at the directory.
      workdir: the evaluator's own directory: its progress file and goodput ledger
        (default ``<checkpoint_dir>/sidecar``; give each evaluator of a directory its own).

    Raises:
      TypeError / ValueError: a step that is not callable, bad counts or intervals.

    Attributes:
      history: a ``dt.History`` whose ``epoch`` holds the evaluated checkpoints' steps.
      results: one ``{"step", "metrics", "lag_s"}`` per recorded evaluation; ``lag_s``:
        seconds from the checkpoint's commit to its result's record.
      stopped_by_signal: whether SIGTERM ended :meth:`start`.
      polls: how many times process 0 has listed the directory.
    """

    def __init__(
        self,
        eval_step: Callable[..., Any],
        data: Iterable[Any],
        checkpoint_dir: str | os.PathLike[str],
        *,
        state: Any,
        strategy: Any = None,
        steps: int | None = None,
        max_evaluations: int | None = None,
        callbacks: Sequence[Callback] | None = None,
        every_checkpoint: bool = False,
        timeout: float | None = None,
        poll_interval: float = 1.0,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not callable(eval_step):
            raise TypeError(f"`eval_step` must be a function. Received: {eval_step!r}.")
        self.checkpoint_dir = os.path.abspath(check_directory_arg(checkpoint_dir, "Sidecar"))
        for name, value in (("timeout", timeout), ("poll_interval", poll_interval)):
            if value is not None and not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"`{name}` must be seconds >= 0. Received: {value!r}.")
        self.trainer = Trainer(strategy, eval_step=eval_step)
        self.strategy = self.trainer.strategy
        self.data = data
        self.steps = optional_positive_int("steps", steps)
        self.max_evaluations = optional_positive_int("max_evaluations", max_evaluations)
        self.every_checkpoint = bool(every_checkpoint)
        self.timeout, self.poll_interval = timeout, float(poll_interval)
        self.workdir = os.fspath(workdir or os.path.join(self.checkpoint_dir, "sidecar"))
        self._callbacks = CallbackList(list(callbacks or ()), self.trainer)
        self._target = self.strategy.put_replicated(state)
        self.history = History()
        self.results: list[dict[str, Any]] = []
        self.stopped_by_signal = False
        self.polls = 0
        self._skipped: list[int] = []
        self._manager: Any = None
        self._loaded_states = False

    # ------------------------------------------------------------------ the loop
    def start(self) -> History:
        """Follows the directory until the training's final checkpoint is evaluated,
        ``max_evaluations`` are done or SIGTERM arrives; returns :attr:`history`.

        Raises:
          ValueError: ``checkpoint_dir`` still missing after ``timeout``; a ``state`` the
            checkpoint does not fit (both shapes named); an ``eval_step`` returning no
            metrics; a progress file of another directory.
          TimeoutError: no checkpoint within ``timeout``.
        """
        self._wait_for_directory()
        self._mgr()  # now, on every process: orbax's constructor meets the others at a barrier
        self._load_progress()
        ledger = goodput.Ledger(self.workdir, write=self.strategy.is_chief)
        goodput.set_current(ledger)  # Trainer.evaluate charges "evaluation" to it
        handler = None
        if threading.current_thread() is threading.main_thread():
            from distrain._src.checkpoint.preemption import PreemptionHandler

            handler = PreemptionHandler()
        loop, cbs = self.trainer.loop, self._callbacks
        # The sidecar is this Trainer's loop: a fit-like run, one "epoch" per checkpoint.
        loop.in_fit = True
        loop.epoch = loop.initial_epoch = len(self.results)
        loop.global_step = loop.initial_step = self.results[-1]["step"] if self.results else 0
        loop.history = self.history
        began, ended = time.monotonic(), False
        try:
            cbs.call("on_train_begin", None)
            while True:
                what, step = self._agree(self._decide(handler, began))
                if what == _EVALUATE:
                    self._evaluate_and_record(step, ledger)
                elif what == _WAIT:
                    self._sleep(handler)
                else:
                    self._say_stopped(what)
                    break
            cbs.call("on_train_end", None)
            ended = True
        except BaseException as e:
            cbs.abort(e)
            raise
        finally:
            loop.in_fit = False
            goodput.set_current(None)
            if ended and not self.stopped_by_signal:
                ledger.finished()  # a later start on this workdir is a new run's
            ledger.close()  # an error or a signal: the ledger's end is not finished
            if handler is not None:
                handler.close()
        return self.history

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """Evaluates one checkpoint (default: the newest) and returns its metrics; records
        nothing (``distrain evaluate --checkpoint DIR``).

        Raises:
          ValueError: no checkpoint in the directory, or ``step`` not among them.
          CheckpointCorruptionError: the checkpoint is damaged.
        """
        steps = self._mgr().all_steps()
        if not steps:
            raise ValueError(f"Expected a checkpoint in {self.checkpoint_dir}; it holds none.")
        restored = self._mgr().restore(
            step=steps[-1] if step is None else step, target=self._target
        )
        return self._run_eval(restored.state)

    # ------------------------------------------------------------------ decisions
    def _decide(self, handler: Any, began: float) -> tuple[int, int]:
        """Process 0's choice for this look: ``(what, step)``."""
        if handler is not None and handler.signal_received:
            return _SIGNAL, -1
        if self.max_evaluations is not None and len(self.results) >= self.max_evaluations:
            return _MAX, -1
        if jax.process_index() != 0:
            return _WAIT, -1
        if not os.path.isdir(self.checkpoint_dir):  # e.g. backups deleted after the run
            return _GONE, -1
        finished, _ = finish_mark.read(self.checkpoint_dir)  # before listing: see _FINISHED
        done = {r["step"] for r in self.results} | set(self._skipped)
        last = max(done, default=-1)
        self.polls += 1
        new = [s for s in self._mgr().all_steps() if s > last]
        if new:
            return _EVALUATE, new[0] if self.every_checkpoint else new[-1]
        if finished:  # the mark follows the final commit: every step is listed by now
            return _FINISHED, -1
        if not done and self.timeout is not None and time.monotonic() - began > self.timeout:
            raise TimeoutError(
                f"SidecarEvaluator: expected a checkpoint in {self.checkpoint_dir} within "
                f"timeout={self.timeout:g} s; there is none. Start the training job that "
                "writes it, or raise `timeout` (None waits without limit)."
            )
        return _WAIT, -1

    def _agree(self, mine: tuple[int, int]) -> tuple[int, int]:
        """Process 0's decision, on every process; a signal to any process stops all."""
        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.int64)))
        rows = rows.reshape(-1, 2)
        if (rows[:, 0] == _SIGNAL).any():
            self.stopped_by_signal = True
            return _SIGNAL, -1
        return int(rows[0, 0]), int(rows[0, 1])

    def _sleep(self, handler: Any) -> None:
        deadline = time.monotonic() + self.poll_interval
        while time.monotonic() < deadline:
            if handler is not None and handler.signal_received and jax.process_count() == 1:
                return
            time.sleep(min(0.05, self.poll_interval))

    # ------------------------------------------------------------- one checkpoint
    def _evaluate_and_record(self, step: int, ledger: goodput.Ledger) -> None:
        self._wait_until_listed(step)
        began = time.perf_counter()
        try:
            with ledger.phase("checkpoint"):
                restored = self._mgr().restore(step=step, target=self._target)
        except (CheckpointCorruptionError, ValueError) as e:
            where = os.path.join(self.checkpoint_dir, str(step))
            if os.path.isdir(where) and not isinstance(e, CheckpointCorruptionError):
                raise  # the template does not fit: the caller's error
            why = (
                f"it is damaged ({_one_line(e)})"
                if os.path.isdir(where)
                else "the training job deleted it before it could be read (raise its "
                "max_to_keep, or evaluate faster)"
            )
            self._say(f"SidecarEvaluator: skipping the checkpoint of step {step} in "
                      f"{self.checkpoint_dir}: {why}")  # fmt: skip
            self._skipped.append(step)
            self._save_progress()
            return
        restore_s = time.perf_counter() - began
        if not self._loaded_states:  # a tracker's run id: log into the training's run
            progress = (restored.metadata or {}).get("progress") or {}
            self._callbacks.load_state_dicts(progress.get("callbacks") or {})
            self._loaded_states = True
        logs = {f"eval/{k}": float(v) for k, v in self._run_eval(restored.state).items()}
        loop = self.trainer.loop
        loop.global_step = step
        self._callbacks.call("on_epoch_end", loop.epoch, logs)
        self.history.append(step, logs)
        lag = _committed_ago(os.path.join(self.checkpoint_dir, str(step)))
        self.results.append({"step": step, "metrics": dict(logs), "lag_s": lag})
        self._save_progress()  # after the callbacks: a kill before this is redone
        loop.epoch += 1
        ledger.record("evaluated", checkpoint=step, lag_s=lag, restore_s=round(restore_s, 6))
        shown = " ".join(f"{k}={v:.4g}" for k, v in logs.items())
        lag_text = "" if lag is None else f" ({lag:.1f} s after it was written)"
        self._say(f"SidecarEvaluator: step {step}: {shown}{lag_text}")

    def _run_eval(self, state: Any) -> dict[str, float]:
        logs = self.trainer.evaluate(state, self.data, steps=self.steps)
        if not logs:
            name = getattr(self.trainer.eval_step, "__name__", "eval_step")
            raise ValueError(
                f"`{name}` returned no metrics (an empty dict). Expected a dict of scalars or "
                "dt.metrics objects, e.g. {'loss': loss, 'accuracy': dt.metrics.Accuracy(...)}."
            )
        return logs

    def _wait_until_listed(self, step: int, bound: float = 60.0) -> None:
        """On every process: ``step`` is listed (a shared file system may show it late)."""
        deadline = time.monotonic() + bound
        while step not in self._mgr().all_steps():
            if time.monotonic() > deadline:
                raise ValueError(
                    f"Process {jax.process_index()} does not see step {step} in "
                    f"{self.checkpoint_dir} {bound:g} s after process 0 did. Expected a "
                    "directory every evaluator process shares (one file system)."
                )
            time.sleep(0.05)

    # ------------------------------------------------------------------ the files
    def _mgr(self) -> Any:
        if self._manager is None:
            from distrain._src.checkpoint.manager import CheckpointManager

            self._manager = CheckpointManager(self.checkpoint_dir, read_only=True)
        return self._manager

    def _wait_for_directory(self) -> None:
        began = time.monotonic()
        while not os.path.isdir(self.checkpoint_dir):
            if self.timeout is not None and time.monotonic() - began >= self.timeout:
                raise ValueError(
                    f"SidecarEvaluator: expected the checkpoint directory {self.checkpoint_dir} "
                    f"to exist within timeout={self.timeout:g} s; it does not. Check the path "
                    "the training job writes to (its ModelCheckpoint or checkpoint.dir)."
                )
            time.sleep(min(0.05, self.poll_interval or 0.05))

    def _progress_path(self) -> str:
        return os.path.join(self.workdir, PROGRESS_FILE)

    def _load_progress(self) -> None:
        path = self._progress_path()
        if not os.path.exists(path):
            return
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != _FORMAT or data.get("checkpoint_dir") != self.checkpoint_dir:
            raise ValueError(
                f"The sidecar progress file {path} is not for {self.checkpoint_dir} (it names "
                f"{data.get('checkpoint_dir')!r}, format {data.get('format')!r}). Give each "
                "evaluated directory its own `workdir`."
            )
        self.results = [
            {**r, "metrics": {k: math.nan if v is None else v for k, v in r["metrics"].items()}}
            for r in data["evaluated"]
        ]
        self._skipped = [int(s) for s in data.get("skipped", [])]
        self.history = History()
        for r in self.results:
            self.history.append(r["step"], r["metrics"])

    def _save_progress(self) -> None:
        if not self.strategy.is_chief:
            return
        os.makedirs(self.workdir, exist_ok=True)
        record = {
            "format": _FORMAT,
            "checkpoint_dir": self.checkpoint_dir,
            "evaluated": [{**r, "metrics": _nan_to_none(r["metrics"])} for r in self.results],
            "skipped": self._skipped,
        }
        tmp = f"{self._progress_path()}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f, allow_nan=False)
        os.replace(tmp, self._progress_path())  # whole or not at all: a kill keeps the last

    def _say_stopped(self, why: int) -> None:
        n = len(self.results)
        newest = f" (the newest: step {self.results[-1]['step']})" if n else ""
        if why == _SIGNAL:
            self.stopped_by_signal = True
            self._say(f"SidecarEvaluator: stopped by SIGTERM after {n} evaluation(s){newest}; "
                      "run it again to continue where it stopped")  # fmt: skip
        elif why == _MAX:
            self._say(f"SidecarEvaluator: max_evaluations={self.max_evaluations} reached{newest}")
        elif why == _GONE:
            self._say(f"SidecarEvaluator: {self.checkpoint_dir} was deleted (the training job "
                      f"ended and removed it); {n} evaluation(s){newest}")  # fmt: skip
        else:
            self._say(f"SidecarEvaluator: training finished; {n} evaluation(s){newest}")

    def _say(self, line: str) -> None:
        if self.strategy.is_chief:
            print(line, flush=True)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _committed_ago(path: str) -> float | None:
    """Seconds since the step directory was last changed (its commit), if it can be read."""
    try:
        return round(max(0.0, time.time() - os.stat(path).st_mtime), 3)
    except OSError:
        return None


def _nan_to_none(logs: dict[str, float]) -> dict[str, float | None]:
    return {k: None if math.isnan(v) else v for k, v in logs.items()}
