"""Progress heartbeats: how ``distrain launch`` tells a hung process from a slow one.

A process stuck in a collective (a peer SIGSTOPped, a network partition, a deadlock)
stops the whole job without exiting, and a restart only helps once someone notices. The
launcher gives each process a heartbeat file (``DISTRAIN_HEARTBEAT_FILE``); from the
first finished step on, a daemon thread of the process rewrites it every ``period``
seconds with the last step the training loop finished and the time it last made
progress. Progress is a finished step, or time spent in work that is slow but not stuck:
compiling (the training thread is inside jax's tracing, lowering or compilation), saving
a checkpoint or evaluating (``busy``, entered by the Trainer's phases). The launcher reads
the files (:func:`find_stall`): a process whose last progress is older than
``--hang-timeout`` is hung. A SIGSTOPped process stops its thread too, so its file goes
stale: detection never relies on the stuck process to report itself.

Outside the training loop (after ``fit`` returns, before the next step of a later
``fit``) nothing is watched, nor is a process that exited. Without the environment
variable (no launcher, or ``--hang-timeout 0``) everything here is a no-op that costs a
global lookup.

Example (what the Trainer does; a custom loop does the same)::

    for step, batch in enumerate(batches, 1):
        state = strategy.run(train_step, args=(state, batch))
        heartbeat.progress(step)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

ENV_FILE = "DISTRAIN_HEARTBEAT_FILE"
ENV_PERIOD = "DISTRAIN_HEARTBEAT_PERIOD"
#: The next attempt's note of the hang that ended the previous one (JSON; the goodput
#: ledger records it and its report charges the stall to the ``hang`` bucket).
ENV_AFTER_HANG = "DISTRAIN_AFTER_HANG"
#: Phases that are slow by nature: time in them is progress (``busy``). ``sync`` is an
#: island's outer exchange and round barrier, which the islands' own deadlines bound.
BUSY = ("checkpoint", "evaluation", "sync")
# jax's tracing, lowering and compilation: a training thread inside one of these files is
# compiling, however long it takes (both ends of the supported jax range).
_COMPILING = tuple(
    os.path.join("jax", "_src", *p.split("/"))
    for p in ("compiler.py", "interpreters/mlir.py", "interpreters/partial_eval.py")
)


class _Beat:
    """The process's heartbeat: the training thread's progress, rewritten by a thread."""

    def __init__(self, path: str, period: float) -> None:
        self.path = path
        self.period = period
        self.step = 0
        self.progress_t = time.time()
        self.busy: list[str] = []
        self.paused = False  # outside the training loop: nothing to watch
        self.training_thread = threading.get_ident()
        self._warned = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="distrain-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.write()
            self._stopped.wait(self.period)

    def stop(self) -> None:
        self._stopped.set()

    def activity(self) -> str | None:
        """What slow-but-not-stuck work the training thread is in now, if any."""
        if self.busy:
            return self.busy[-1]
        frame = sys._current_frames().get(self.training_thread)
        while frame is not None:
            if frame.f_code.co_filename.endswith(_COMPILING):
                return "compile"
            frame = frame.f_back
        return None

    def write(self) -> None:
        now = time.time()
        busy = self.activity()
        if busy is not None:
            self.progress_t = now
        record = {
            "watch": not self.paused,
            "pid": os.getpid(),
            "step": self.step,
            "progress_t": self.progress_t,
            "busy": busy,
            "t": now,
        }
        tmp = f"{self.path}.tmp"
        try:
            with self._lock, open(tmp, "w") as f:  # the thread, or pause()
                json.dump(record, f)
                f.close()
                os.replace(tmp, self.path)  # the launcher never reads half a record
        except OSError as e:
            if not self._warned:  # the launcher will see the file go stale: say why once
                self._warned = True
                warnings.warn(f"Cannot write the heartbeat file {self.path}: {e}", stacklevel=1)


_beat: _Beat | None = None
_absent = False  # no launcher asked for one: every later call returns at once


def progress(step: int) -> None:
    """The training loop finished global step ``step`` (starts the heartbeat at the first
    call when the launcher asked for one)."""
    global _beat, _absent
    if _beat is None:
        if _absent:
            return  # called every step: one global read, not an environment lookup
        path = os.environ.pop(ENV_FILE, None)  # this process's: a program it starts has none
        period = os.environ.pop(ENV_PERIOD, "1")
        if not path:
            _absent = True
            return
        _beat = _Beat(path, float(period))
    _beat.step = int(step)
    _beat.progress_t = time.time()
    _beat.paused = False


def pause() -> None:
    """The training loop ended (or has not started again): no hang to watch for until the
    next :func:`progress` (a final evaluation, the program's exit, a later ``fit``)."""
    if _beat is not None and not _beat.paused:
        _beat.paused = True
        _beat.write()  # at once: the program may end (and stop beating) right after


@contextlib.contextmanager
def _busy(beat: _Beat, name: str) -> Iterator[None]:
    beat.busy.append(name)
    try:
        yield
    finally:
        beat.busy.pop()
        beat.progress_t = time.time()


def running() -> bool:
    """Whether this process beats (launched with a heartbeat file, past its first step)."""
    return _beat is not None


def busy(name: str) -> contextlib.AbstractContextManager[None]:
    """Marks slow work that is not a hang (a save, an evaluation) while inside."""
    beat = _beat
    return contextlib.nullcontext() if beat is None else _busy(beat, name)


# ------------------------------------------------------------------ the launcher's side


@dataclasses.dataclass(frozen=True)
class Stall:
    """A process that made no progress for longer than the timeout."""

    process: int
    pid: int
    step: int
    since: float  # wall-clock time of its last progress
    detected: float

    @property
    def seconds(self) -> float:
        return self.detected - self.since

    def to_env(self) -> str:
        """The note for the next attempt (``ENV_AFTER_HANG``)."""
        return json.dumps(dataclasses.asdict(self))


def read(path: str) -> dict[str, Any] | None:
    """One heartbeat file, or None before the process's first step."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def find_stall(
    paths: Sequence[str | None], timeout: float, now: float | None = None
) -> Stall | None:
    """A process (index into ``paths``; None: not watched) that made no progress for over
    ``timeout`` s.

    When a process is stuck its peers soon wait for it in a collective and stall too; the
    one to name is the cause: a process whose heartbeat itself went silent (stopped,
    frozen) before one that still beats while waiting, then the one stalled longest.
    """
    now = time.time() if now is None else now
    stalls = []
    for i, path in enumerate(paths):
        record = None if path is None else read(path)
        if record is None or not record["watch"]:
            continue
        if now - float(record["progress_t"]) > timeout:
            silent = now - float(record["t"]) > timeout / 2
            stall = Stall(
                i, int(record["pid"]), int(record["step"]), float(record["progress_t"]), now
            )
            stalls.append((not silent, stall.since, stall))
    return min(stalls, key=lambda s: s[:2])[2] if stalls else None


def after_hang() -> dict[str, Any] | None:
    """The launcher's note of the hang that ended the previous attempt, if any."""
    text = os.environ.get(ENV_AFTER_HANG)
    return json.loads(text) if text else None


class Watch:
    """The launcher's watch over one job's heartbeat files (one per process).

    Example:
      >>> watch = Watch(2, timeout=600.0)
      >>> env = watch.env(0)               # for process 0's environment
      >>> stall = watch.check([True, True])  # None, or the process that hung
    """

    def __init__(self, nproc: int, timeout: float) -> None:
        self.timeout = timeout
        # Beats often enough that a stale file means a stall, not a slow writer.
        self.period = min(1.0, timeout / 5)
        self.dir = tempfile.mkdtemp(prefix="distrain-heartbeat-")
        self.paths = [os.path.join(self.dir, f"process-{i}.json") for i in range(nproc)]
        self._next = 0.0

    def env(self, index: int) -> dict[str, str]:
        return {ENV_FILE: self.paths[index], ENV_PERIOD: f"{self.period:g}"}

    def reset(self) -> None:
        """Before an attempt: the previous attempt's files say nothing about this one."""
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def check(self, running: Sequence[bool]) -> Stall | None:
        """The stalled process among the ``running`` ones, if any (reads the files at most
        every ``period``)."""
        now = time.time()
        if now < self._next:
            return None
        self._next = now + self.period
        paths = [p if alive else None for p, alive in zip(self.paths, running, strict=True)]
        return find_stall(paths, self.timeout, now)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
