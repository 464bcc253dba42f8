"""The goodput ledger: where each second of a process went, appended to a file.

A :class:`Ledger` charges the wall time of its process to one bucket at a time: the
innermost open :meth:`Ledger.phase` (``"step"``, ``"input"``, ``"checkpoint"``,
``"evaluation"``, ``"sync"``: an island's outer exchange and its wait at the round
barrier), else ``"startup"`` until the first step and ``"other"`` after it. ``"hang"``
is charged after the fact (:meth:`Ledger.move`): an island learns only when its round
closes that part of its barrier wait was for a peer found hung.
Compilation is read from ``jax.monitoring``'s compile spans and moved out of the phase
it happened in. The cumulative totals are appended to ``WORKDIR/goodput.jsonl`` as
JSON lines (one process writes: the chief), at least every ``interval`` seconds while
steps run and at every save, resume and end, so a SIGKILL loses at most the last
interval; a line torn by the kill is skipped by the report. ``report.py`` reads the
file back across every attempt (restarts by ``distrain launch``, Ray, Slurm...).

Example:
  >>> ledger = Ledger("runs/exp")                # a custom loop
  >>> for batch in batches:
  ...     with ledger.phase("step"):
  ...         state, loss = strategy.run(train_step, args=(state, batch))
  ...     ledger.progress(step)                  # the loop's global step
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from distrain._src.goodput import heartbeat

FILENAME = "goodput.jsonl"
#: The buckets a process's time goes to (the report adds "lost" and "downtime").
PHASES = ("step", "input", "checkpoint", "evaluation", "sync")
BUCKETS = ("startup", "compile", *PHASES, "hang", "other")
VERSION = 1


def process_start_time() -> float:
    """When this process started (wall clock, seconds): from ``/proc`` on Linux, so the
    interpreter's start-up and imports count; elsewhere, when distrain was imported. A
    warm spare of ``distrain launch`` started when it was handed its rank
    (:func:`restart_clock`)."""
    if _handed_over is not None:
        return _handed_over
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        # The start is in clock ticks since boot (CLOCK_BOOTTIME). Measured back from now,
        # not added to /proc/stat's btime, which is whole seconds (up to 1 s off).
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - float(fields[19]) / os.sysconf(
            "SC_CLK_TCK"
        )
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()
_handed_over: float | None = None


def restart_clock(start: float) -> None:
    """This process starts its work at ``start`` (wall clock): a warm spare that imported
    everything while it waited, then was handed a rank. Its start-up and milestones are
    measured from there, as a new process's would be from its exec; its imports are done
    (the ``imported`` milestone is now).

    Example:
      >>> restart_clock(time.time())  # in the spare, before the program runs
    """
    global _handed_over
    _handed_over = float(start)
    _milestones.clear()
    milestone("imported")


class _CompileSpans:
    """Collects jax's compile spans (tracing, lowering, backend compile) from the public
    ``jax.monitoring`` listener, for every ledger of the process."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            import jax.monitoring

            jax.monitoring.register_event_time_span_listener(self._on_span)
            self.installed = True

    def _on_span(self, event: str, start_time: float, end_time: float, **_: str | int) -> None:
        if event in self.EVENTS:
            with self.lock:
                self.spans.append((start_time, end_time))

    def take(self, begin: float, end: float) -> float:
        """Seconds of ``[begin, end]`` covered by compile spans (overlaps counted once);
        spans that ended by ``end`` are dropped."""
        with self.lock:
            spans = sorted(self.spans)
            self.spans = [s for s in spans if s[1] > end]
        covered, reach = 0.0, begin
        for a, b in spans:
            a, b = max(a, reach), min(b, end)
            if b > a:
                covered += b - a
                reach = b
        return covered


_COMPILE = _CompileSpans()


class Ledger:
    """Charges this process's wall time to buckets and appends them to ``goodput.jsonl``.

    One ledger per work directory and process (``Ledger(d)`` twice gives the same
    object); it writes only where ``write`` is true (pass ``False`` on non-chief
    processes) and closes at exit.

    Args:
      workdir: the run's directory (created if missing); the ledger is
        ``workdir/goodput.jsonl`` and accumulates every attempt of the run.
      write: append records (the chief); False keeps the accounting in memory only.
      interval: seconds between progress records while steps run.

    Raises:
      OSError: ``workdir`` cannot be written.
      ValueError: ``interval`` is not positive.
    """

    _open: dict[str, Ledger] = {}

    def __new__(cls, workdir: str | os.PathLike[str], **kwargs: Any) -> Ledger:
        path = os.path.abspath(os.path.join(os.fspath(workdir), FILENAME))
        if path in cls._open:
            return cls._open[path]
        return super().__new__(cls)

    def __init__(
        self, workdir: str | os.PathLike[str], *, write: bool = True, interval: float = 1.0
    ) -> None:
        path = os.path.abspath(os.path.join(os.fspath(workdir), FILENAME))
        if path in Ledger._open:
            return
        if not interval > 0:
            raise ValueError(f"Ledger interval must be > 0 seconds. Received: {interval!r}.")
        self.path = path
        self.interval = float(interval)
        self.totals = dict.fromkeys(BUCKETS, 0.0)
        self.step: int | None = None
        self._stack: list[str] = []
        self._started_steps = False
        self._done = False
        self._lock = threading.RLock()
        self._file: Any = None
        self._start = process_start_time()
        self._mark = self._start
        self._last_write = 0.0
        self.attempt = f"{socket.gethostname()}:{os.getpid()}:{self._start:.3f}"
        _COMPILE.install()
        if write:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._file = open(path, "a")  # noqa: SIM115 - closed by close()/at exit
        Ledger._open[path] = self
        atexit.register(self.close)
        hang = heartbeat.after_hang()  # the previous attempt ended hung: the report says so
        self._record(
            "start",
            process_start=self._start,
            pid=os.getpid(),
            milestones=dict(_milestones),
            **({"after_hang": hang} if hang else {}),
        )

    # ----------------------------------------------------------- accounting
    def _charge(self, now: float) -> None:
        """Gives the time since the last mark to the current bucket, less compilation."""
        if now <= self._mark:
            return
        compiled = _COMPILE.take(self._mark, now)
        if self._stack:
            bucket = self._stack[-1]
        else:
            bucket = "other" if self._started_steps else "startup"
        self.totals["compile"] += compiled
        self.totals[bucket] += (now - self._mark) - compiled
        self._mark = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charges the time inside to ``name`` (one of ``PHASES``); phases nest, and the
        innermost gets the time (a save inside a step's callbacks is checkpoint time). A
        save or an evaluation also tells the heartbeat the process is busy, not hung."""
        if name not in PHASES:  # a typo would silently charge the wrong bucket
            raise ValueError(f"Unknown goodput phase {name!r}; expected one of {PHASES}.")
        with self._lock:
            self._charge(time.time())
            self._stack.append(name)
            if name == "step":
                self._started_steps = True
        try:
            with heartbeat.busy(name) if name in heartbeat.BUSY else _NO_PHASE:
                yield
        finally:
            with self._lock:
                self._charge(time.time())
                self._stack.pop()

    def progress(self, step: int) -> None:
        """The loop reached global step ``step``; writes a record every ``interval`` (and
        beats the heartbeat ``distrain launch --hang-timeout`` watches)."""
        self.step = int(step)
        heartbeat.progress(step)
        if time.time() - self._last_write >= self.interval:
            self._record("tick")

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was written (a point a later attempt may resume from)."""
        self.step = int(step)
        self._record("save")

    def resumed(self, step: int) -> None:
        """This attempt continues from a checkpoint of ``step``: the report counts the
        steps an earlier attempt ran past it as lost work. What :func:`note_restore`
        noted about the restore (its tier and seconds) goes in the same record."""
        global _restore_note
        self.step = int(step)
        fields, _restore_note = _restore_note or {}, None
        self._record("resume", **fields)

    def move(self, seconds: float, source: str, target: str) -> float:
        """Moves up to ``seconds`` already charged to bucket ``source`` to ``target`` (time
        whose cause became known later); returns the seconds moved.

        Raises:
          ValueError: a bucket that is not one of ``BUCKETS``.
        """
        if source not in BUCKETS or target not in BUCKETS:
            raise ValueError(
                f"Unknown goodput bucket in move({source!r} -> {target!r}); expected two of "
                f"{BUCKETS}."
            )
        with self._lock:
            self._charge(time.time())
            moved = min(max(0.0, seconds), self.totals[source])
            self.totals[source] -= moved
            self.totals[target] += moved
            return moved

    def record(self, event: str, **fields: Any) -> None:
        """Appends a record of ``event`` (with the totals so far) now."""
        self._record(event, **fields)

    def _record(self, event: str, **fields: Any) -> None:
        with self._lock:
            now = time.time()
            self._charge(now)
            self._last_write = now
            if self._file is None:
                return
            line = {
                "v": VERSION,
                "event": event,
                "t": now,
                "attempt": self.attempt,
                "step": self.step,
                "buckets": {k: round(v, 6) for k, v in self.totals.items()},
                **fields,
            }
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def finished(self) -> None:
        """The run's work is done: training, and what the program does after it when it
        says so itself (``dt.callbacks.Goodput(finish_with_fit=False)``). A later attempt
        that starts afresh is a new run; an attempt killed before this is a failure."""
        self._done = True
        self._record("fit_end")

    def close(self) -> None:
        """Writes the ``end`` record and closes the file (also done at exit)."""
        with self._lock:
            if Ledger._open.get(self.path) is not self:
                return
            self._record("end", finished=self._done)
            if self._file is not None:
                self._file.close()
                self._file = None
            del Ledger._open[self.path]
            atexit.unregister(self.close)


_current: Ledger | None = None
_restore_note: dict[str, Any] | None = None
_milestones: dict[str, float] = {}


def milestone(name: str) -> None:
    """Notes the first time this process reached ``name`` (e.g. ``"imported"``,
    ``"distributed"``, ``"model"``, ``"data"``); a ledger's start record carries them,
    so the report can break start-up down."""
    _milestones.setdefault(name, time.time())


def note_restore(**fields: Any) -> None:
    """Notes how the state was restored (e.g. ``source="local", seconds=0.4``) for the
    next :meth:`Ledger.resumed`: the restore runs before the ledger of the ``fit``
    exists."""
    global _restore_note
    _restore_note = fields


def current() -> Ledger | None:
    """The ledger the running ``fit`` charges (set by ``dt.callbacks.Goodput``), or None."""
    return _current


def set_current(ledger: Ledger | None) -> None:
    """Makes ``ledger`` the one the Trainer's phases charge (None: none)."""
    global _current
    _current = ledger


_NO_PHASE = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """``current().phase(name)``, or a shared no-op context when no ledger is current:
    the Trainer enters it twice per dispatch, so without a ledger it costs a lookup (a
    save or an evaluation still tells the heartbeat that the process is busy, not hung)."""
    ledger = _current
    if ledger is not None:
        return ledger.phase(name)
    return heartbeat.busy(name) if name in heartbeat.BUSY else _NO_PHASE


def settle_steps(state: Any) -> None:
    """Waits, as step time, for the steps still computing ``state`` (only when a ledger
    is current): the save or evaluation that follows would wait for them anyway, and
    would be charged for it."""
    if _current is not None:
        import jax

        with _current.phase("step"):
            jax.block_until_ready(state)


def rotate_finished(workdir: str | os.PathLike[str]) -> str | None:
    """Moves a ledger whose last attempt finished training aside (``goodput-<time>.jsonl``)
    so a new run in the same directory starts its own; returns the new name, or None
    when there is nothing to move (no ledger, or one a restart must continue)."""
    path = os.path.join(os.fspath(workdir), FILENAME)
    if os.path.abspath(path) in Ledger._open or not os.path.exists(path):
        return None
    last = None
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                last = json.loads(line)
    if not (isinstance(last, dict) and last.get("event") == "end" and last.get("finished")):
        return None
    moved = os.path.join(os.fspath(workdir), f"goodput-{int(last['t'])}.jsonl")
    os.replace(path, moved)
    return moved
