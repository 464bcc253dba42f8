"""What ``ClusterCoordinator.schedule`` queues: closures, their results, their queue.

A :class:`Closure` is one scheduled function with its step number (its place in
schedule order, kept when it is retried) and the :class:`RemoteValue` it resolves;
the :class:`ClosureQueue` hands them to the worker drivers by step number and counts
the running ones, so that ``join`` knows when everything is done.

Example:
  >>> queue = ClosureQueue()
  >>> queue.put(Closure(0, step, (iterator,), {}))
  >>> queue.get().value.fetch()
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from typing import Any

import jax

from distrain._src.ps.step import WorkerStep

__all__ = ["Closure", "ClosureQueue", "RemoteValue"]


class RemoteValue:
    """The future result of a scheduled function."""

    def __init__(self, name: str):
        self._name = name
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the function and returns its outputs as NumPy arrays.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            Exception: the error the function raised, or `FunctionCancelledError`.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self._name} did not finish within {timeout} s.")
        if self._error is not None:
            raise self._error
        return jax.device_get(self._value)

    def __repr__(self) -> str:
        state = "pending" if not self._event.is_set() else "failed" if self._error else "done"
        return f"RemoteValue({self._name}, {state})"


class Closure:
    """One scheduled function: its step number, arguments and future result."""

    __slots__ = ("seq", "step", "args", "kwargs", "value")

    def __init__(self, seq: int, step: WorkerStep, args: tuple, kwargs: dict):
        self.seq, self.step, self.args, self.kwargs = seq, step, args, kwargs
        self.value = RemoteValue(f"step {seq} ({step!r})")

    def __lt__(self, other: Closure) -> bool:
        return self.seq < other.seq


class ClosureQueue:
    """Scheduled functions by step number, and how many are running."""

    def __init__(self) -> None:
        self._heap: list[Closure] = []
        self.cond = threading.Condition()
        self.running = 0
        self.stopped = False

    def put(self, closure: Closure, *, was_running: bool = False) -> None:
        with self.cond:
            heapq.heappush(self._heap, closure)
            self.running -= int(was_running)
            self.cond.notify_all()

    def get(self) -> Closure | None:
        with self.cond:
            self.cond.wait_for(lambda: self._heap or self.stopped)
            if self.stopped:
                return None
            self.running += 1
            return heapq.heappop(self._heap)

    def swap_if_earlier(self, closure: Closure) -> Closure:
        """Trades ``closure`` for a queued one with a smaller step number, if any."""
        with self.cond:
            if self._heap and self._heap[0].seq < closure.seq:
                return heapq.heapreplace(self._heap, closure)
            return closure

    def done(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def drain(self) -> list[Closure]:
        with self.cond:
            taken, self._heap = self._heap, []
            self.cond.notify_all()
            return taken

    def idle(self) -> bool:
        with self.cond:
            return not self._heap and self.running == 0

    def wait_idle(self, abort: Callable[[], bool]) -> None:
        with self.cond:
            self.cond.wait_for(lambda: (not self._heap and self.running == 0) or abort())

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
