"""Callbacks that report progress to people: progress bar, TensorBoard, CSV, JSON lines.

All of them act on the chief process only (the others skip every hook), check at
``fit`` start that their output can be written, and append instead of overwrite when
``fit`` resumes a run (``BackupAndRestore``), so a resumed run keeps one log.

Example:
  >>> callbacks = [dt.callbacks.ProgressBar(),
  ...              dt.callbacks.TensorBoard("runs/exp1"),
  ...              dt.callbacks.CSVLogger("runs/exp1/epochs.csv")]
"""

from __future__ import annotations

import csv
import json
import math
import numbers
import os
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from distrain._src.train.callbacks.base import Callback, Logs, StepInfo, ensure_writable_dir


def _chief(cb: Callback) -> bool:
    return cb.trainer is None or cb.trainer.is_chief


def _resumed(cb: Callback) -> bool:
    return cb.trainer is not None and cb.trainer.loop.initial_step > 0


def format_logs(logs: Mapping[str, Any]) -> str:
    """``"loss=0.1234 accuracy=0.9712"``: 4 significant digits, the order of ``logs``."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in logs.items())


def _fmt(v: Any) -> str:
    try:
        return f"{float(v):.4g}"
    except (TypeError, ValueError):
        return str(v)


def _json_safe(logs: Mapping[str, Any]) -> dict[str, Any]:
    """Integers stay integers (``"step": 50``), other numbers become floats, and
    non-finite floats ``None`` (JSON has no NaN)."""
    out: dict[str, Any] = {}
    for k, v in logs.items():
        if isinstance(v, bool) or v is None or isinstance(v, str):
            out[k] = v
        elif isinstance(v, numbers.Integral) or (
            getattr(v, "ndim", None) == 0 and np.issubdtype(getattr(v, "dtype", float), np.integer)
        ):
            out[k] = int(v)
        else:
            try:
                f = float(v)
                out[k] = None if math.isnan(f) or math.isinf(f) else f
            except (TypeError, ValueError):
                out[k] = v
    return out


def _before_resume(record: Mapping[str, Any], step: int, epoch: int) -> bool:
    """Whether a logged record belongs to the run up to a resume at ``step``/``epoch``.

    Step events at or before the resumed step stay; an epoch's event stays if that epoch
    was finished when the backup was made; the rest are redone by the resumed run.
    """
    event = record.get("event")
    if event == "step":
        return isinstance(record.get("step"), (int, float)) and record["step"] <= step
    if event == "epoch":
        return isinstance(record.get("epoch"), (int, float)) and record["epoch"] < epoch
    return True  # e.g. an evaluate() outside fit: not part of the training timeline


class ProgressBar(Callback):
    """A tqdm bar per epoch: steps, steps/s, ETA (when the epoch length is known), metrics.

    Metrics are refreshed when the Trainer syncs with the host (every ``log_every``
    steps), so the bar itself never adds a device sync. On a stream that is not a
    terminal (a log file, a pipe, a launcher's prefixed output) a bar's redraws would
    pile up, so it writes one line per epoch instead:
    ``epoch 2/5: 100/100 steps, 41.2 step/s, 2.4 s, loss=0.1234 val_loss=0.2345``.

    Args:
      file: stream to draw on (default ``sys.stderr``).
      leave: keep each epoch's finished bar on screen.
      redraw: draw a live bar (True) or one line per epoch (False); default: a bar only
        when ``file`` is a terminal.
    """

    def __init__(
        self, file: IO[str] | None = None, *, leave: bool = True, redraw: bool | None = None
    ) -> None:
        self.file = file
        self.leave = leave
        self.redraw = redraw
        self._bar: Any = None
        self._line: dict[str, Any] | None = None  # the epoch's line when not redrawing

    def _stream(self) -> IO[str]:
        return self.file or sys.stderr

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if not _chief(self):
            return
        t = self.trainer
        total = t.loop.steps_per_epoch if t is not None else None
        epochs = t.loop.epochs if t is not None else None
        desc = f"epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")
        initial = t.loop.step_in_epoch if t is not None else 0
        redraw = self.redraw
        if redraw is None:
            isatty = getattr(self._stream(), "isatty", None)
            redraw = bool(isatty and isatty())
        if not redraw:
            self._line = {"desc": desc, "total": total, "steps": initial, "initial": initial,
                          "start": time.monotonic()}  # fmt: skip
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=self._stream(),
            leave=self.leave,
            dynamic_ncols=True,
        )

    def on_train_batch_end(self, info: StepInfo) -> None:
        if self._line is not None:
            self._line["steps"] += info.num_steps
        if self._bar is None:
            return
        self._bar.update(info.num_steps)
        if info.logs:
            self._bar.set_postfix_str(format_logs(info.logs), refresh=False)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._line is not None:
            line, self._line = self._line, None
            seconds = time.monotonic() - line["start"]
            rate = (line["steps"] - line["initial"]) / seconds if seconds > 0 else 0.0
            total = f"/{line['total']}" if line["total"] else ""
            text = f"{line['desc']}: {line['steps']}{total} steps, {rate:.1f} step/s"
            text += f", {seconds:.1f} s"
            if logs:
                text += ", " + format_logs(logs)
            print(text, file=self._stream(), flush=True)
        if self._bar is None:
            return
        if logs:
            self._bar.set_postfix_str(format_logs(logs), refresh=False)
        self._bar.close()
        self._bar = None

    def on_train_abort(self, error: BaseException) -> None:
        self._line = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class TensorBoard(Callback):
    """Writes scalars as TensorBoard event files (tensorboardX; no TensorFlow needed).

    Tags: ``train/<metric>`` at every log step (x axis: global step) and
    ``epoch/<metric>`` (including ``val_`` metrics) at every epoch end; a metric already
    named with a prefix keeps its name (a ``dt.SidecarEvaluator``'s ``eval/<metric>``, x
    axis: the checkpoint's step).

    Args:
      log_dir: directory of the event files; created if missing.
      flush_secs: how often the writer flushes to disk.

    Raises:
      OSError: at ``fit`` start if ``log_dir`` cannot be written.

    Example:
      >>> dt.callbacks.TensorBoard("runs/mnist")   # then: tensorboard --logdir runs
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, flush_secs: int = 10) -> None:
        self.log_dir = os.fspath(log_dir)
        self.flush_secs = flush_secs
        self._writer: Any = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if not _chief(self):
            return
        ensure_writable_dir(self.log_dir, "TensorBoard log")
        from tensorboardX import SummaryWriter

        # A resumed run writes to the same directory; TensorBoard merges event files and,
        # with purge_step, hides the killed run's events after the resumed step.
        purge = self._fit_trainer.loop.initial_step + 1 if _resumed(self) else None
        self._writer = SummaryWriter(self.log_dir, flush_secs=self.flush_secs, purge_step=purge)

    def on_train_batch_end(self, info: StepInfo) -> None:
        if self._writer is None or not info.logs:
            return
        for name, value in info.logs.items():
            self._writer.add_scalar(f"train/{name}", value, info.step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._writer is None or not logs:
            return
        step = self.trainer.loop.global_step if self.trainer is not None else epoch
        for name, value in logs.items():
            self._writer.add_scalar(name if "/" in name else f"epoch/{name}", value, step)
        self._writer.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._close()

    def on_train_abort(self, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CSVLogger(Callback):
    """One CSV row per epoch: ``epoch``, ``step`` and every metric (``val_`` included).

    New metric columns (e.g. validation that starts at epoch 2) extend the header; the
    file is rewritten atomically at each epoch end, so it is always a valid CSV.

    Args:
      filename: the CSV file; its directory is created if missing.
      append: keep rows already in the file (always done when ``fit`` resumes).

    Raises:
      OSError: at ``fit`` start if the file's directory cannot be written.
    """

    def __init__(self, filename: str | os.PathLike[str], *, append: bool = False) -> None:
        self.filename = os.fspath(filename)
        self.append = append
        self._rows: list[dict[str, Any]] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if not _chief(self):
            return
        ensure_writable_dir(os.path.dirname(os.path.abspath(self.filename)), "CSVLogger")
        self._rows = []
        if (self.append or _resumed(self)) and os.path.exists(self.filename):
            with open(self.filename, newline="") as f:
                self._rows = list(csv.DictReader(f))
            if _resumed(self):
                # Rows of epochs after the restored checkpoint are redone by this run.
                done = self._fit_trainer.loop.initial_epoch
                self._rows = [r for r in self._rows if int(r.get("epoch", 0)) < done]

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._rows is None:
            return
        step = self.trainer.loop.global_step if self.trainer is not None else ""
        self._rows.append({"epoch": epoch, "step": step, **dict(logs or {})})
        fields: list[str] = []
        for row in self._rows:
            fields += [k for k in row if k not in fields]
        tmp = self.filename + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, restval="")
            writer.writeheader()
            writer.writerows(self._rows)
        os.replace(tmp, self.filename)

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._rows = None


class JSONLinesLogger(Callback):
    """Appends one JSON object per event to a file, for scripts and dashboards.

    Events: ``{"event": "step", "step", "epoch", <metrics>}`` at every log step,
    ``{"event": "epoch", ...}`` at every epoch end and ``{"event": "test", ...}`` after
    ``evaluate``. Non-finite values are written as ``null``.

    Args:
      filename: the ``.jsonl`` file; its directory is created if missing.
      append: keep what the file holds (always done when ``fit`` resumes).
      log_steps: also write the per-step events (not only epochs).

    Raises:
      OSError: at ``fit`` start if the file's directory cannot be written.
    """

    def __init__(
        self, filename: str | os.PathLike[str], *, append: bool = False, log_steps: bool = True
    ) -> None:
        self.filename = os.fspath(filename)
        self.append = append
        self.log_steps = log_steps
        self._file: IO[str] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if not _chief(self):
            return
        ensure_writable_dir(os.path.dirname(os.path.abspath(self.filename)), "JSONLinesLogger")
        if _resumed(self) and os.path.exists(self.filename):
            loop = self._fit_trainer.loop
            self._keep_until(loop.initial_step, loop.initial_epoch)
        mode = "a" if self.append or _resumed(self) else "w"
        self._file = open(self.filename, mode)  # noqa: SIM115 - closed in on_train_end/abort

    def _keep_until(self, step: int, epoch: int) -> None:
        """Drops the lines the killed run wrote after the step ``fit`` resumes from (the
        resumed run writes them again) and a torn last line; keeps every other line as
        it was. The file is replaced atomically."""
        with open(self.filename) as f:
            lines = f.read().splitlines(keepends=True)
        kept = []
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:
                    continue  # torn by the kill mid-write
                kept.append(line)  # not ours to judge: keep it
                continue
            if not isinstance(record, dict) or _before_resume(record, step, epoch):
                kept.append(line if line.endswith("\n") else line + "\n")
        tmp = self.filename + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.filename)

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(_json_safe(record)) + "\n")
        self._file.flush()

    def on_train_batch_end(self, info: StepInfo) -> None:
        if self.log_steps and info.logs:
            self._write({"event": "step", "step": info.step, "epoch": info.epoch, **info.logs})

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        step = self.trainer.loop.global_step if self.trainer is not None else None
        self._write({"event": "epoch", "step": step, "epoch": epoch, **dict(logs or {})})

    def on_test_end(self, logs: Logs | None = None) -> None:
        if self.trainer is not None and self.trainer.loop.in_fit:
            return  # validation inside fit is part of the epoch event
        if not _chief(self):
            return
        ensure_writable_dir(os.path.dirname(os.path.abspath(self.filename)), "JSONLinesLogger")
        with open(self.filename, "a") as f:
            f.write(json.dumps(_json_safe({"event": "test", **dict(logs or {})})) + "\n")

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._close()

    def on_train_abort(self, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
