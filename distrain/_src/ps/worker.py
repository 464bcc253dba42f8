"""A worker: runs compiled steps on one device, talking to the servers through callbacks.

`StepRuntime` is the host side of the compiled steps of one process: the
``io_callback`` targets. Callbacks never raise into XLA (an exception there
surfaces as an opaque runtime error and a logged traceback); a failing
callback records the exception under the step's ticket and returns a harmless
value (zeros, or "not pushed"), and `WorkerCore.run` raises the recorded
exception once the program returns. This is also where faults are injected
for tests (`arm`).

`WorkerCore` runs one scheduled function: it resolves per-worker iterators,
places the arguments on the worker's device, runs the program, and reports.
The in-process backend runs it in a coordinator thread; the Ray backend runs
it inside a worker actor.
"""

from __future__ import annotations

import itertools
import threading
import typing
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from distrain._src.ps.backend import Worker
from distrain._src.ps.errors import WorkerFailure
from distrain._src.ps.per_worker_datasets import WorkerInputs
from distrain._src.ps.servers import ServerGroup
from distrain._src.ps.step import RUNTIMES, StepProgram

FAULT_POINTS = ("pull", "push", "result")
_runtime_ids = itertools.count()


def _default_fault(worker: int, at: str) -> None:
    raise WorkerFailure(f"injected failure of worker {worker} at {at!r}")


def _ticket(ticket: Any) -> tuple[int, int]:
    # JAX hands callbacks jax.Arrays on CPU device 0. Indexing or slicing them
    # would run JAX computations inside the callback; computations on device 0
    # can wait behind a worker's program that is itself blocked in a callback.
    # Take plain NumPy copies first, before any lock, and never touch JAX again.
    t = np.asarray(ticket)
    return int(t[0]), int(t[1])


class StepRuntime:
    """Host side of the compiled steps of one process.

    Args:
        group: the parameter servers.
        fault: called when an armed fault fires (default: raise `WorkerFailure`;
            a Ray worker exits its process instead).
    """

    def __init__(self, group: ServerGroup, fault: Callable[[int, str], None] = _default_fault):
        self.group = group
        self.runtime_id = next(_runtime_ids)
        RUNTIMES[self.runtime_id] = self
        self._fault = fault
        self._lock = threading.Lock()
        self._armed: dict[int, str] = {}
        self._failures: dict[tuple[int, int], BaseException] = {}
        self._zeros = [np.zeros(s.shape, s.dtype) for s in group.layout.leaf_specs]

    def arm(self, worker: int, at: str) -> None:
        """Makes ``worker`` fail at point ``at`` of its next step (one shot)."""
        if at not in FAULT_POINTS:
            raise ValueError(f"Fault point must be one of {FAULT_POINTS}. Received: at={at!r}.")
        with self._lock:
            self._armed[worker] = at

    def _fires(self, worker: int, at: str) -> bool:
        with self._lock:
            if self._armed.get(worker) == at:
                del self._armed[worker]
                return True
            return False

    def fire_if_armed(self, worker: int, at: str) -> None:
        if self._fires(worker, at):
            self._fault(worker, at)

    def _record(self, seq: int, worker: int, err: BaseException) -> None:
        with self._lock:
            self._failures.setdefault((seq, worker), err)

    def take_failure(self, seq: int, worker: int) -> BaseException | None:
        with self._lock:
            return self._failures.pop((seq, worker), None)

    def pull_callback(self, ticket: Any) -> list[np.ndarray]:
        seq, worker = _ticket(ticket)
        try:
            self.fire_if_armed(worker, "pull")
            return self.group.pull(seq)
        except BaseException as err:  # recorded, re-raised by WorkerCore.run
            self._record(seq, worker, err)
            return self._zeros

    def push_callback(self, ticket: Any, *grads: Any) -> np.int32:
        seq, worker = _ticket(ticket)
        grads = tuple(np.asarray(g) for g in grads)  # see _ticket
        with self._lock:
            if (seq, worker) in self._failures:
                return np.int32(-1)  # the pull failed: these gradients are garbage
        try:
            after_first = None
            if self._fires(worker, "push"):
                after_first = lambda: self._fault(worker, "push")
            return np.int32(self.group.push(seq, grads, after_first=after_first))
        except BaseException as err:
            self._record(seq, worker, err)
            return np.int32(-1)


@typing.final
class WorkerCore(Worker):
    """Runs scheduled steps for worker ``index`` on ``device`` (in a coordinator thread, or
    inside a Ray actor)."""

    def __init__(self, index: int, num_workers: int, device: jax.Device, runtime: StepRuntime):
        self.index = index
        self.device = device
        self.runtime = runtime
        self.inputs = WorkerInputs(index, num_workers)

    def run(
        self,
        program: StepProgram,
        seq: int,
        args: tuple,
        kwargs: dict,
        dataset_fns: Mapping[int, Callable[..., Any]],
    ) -> Any:
        """Runs one step; returns its outputs (arrays on this worker's device).

        Raises:
            WorkerFailure: this worker died during the step (retry elsewhere).
            ParameterServerUnavailableError: a server is gone.
            OutOfRangeError: a per-worker dataset ran out.
            Exception: whatever the step function raised while being traced.
        """
        args, kwargs = self.inputs.resolve((args, kwargs), dataset_fns)
        args, kwargs = jax.device_put((args, kwargs), self.device)
        ticket = np.array([seq, self.index, self.runtime.runtime_id], np.int32)
        ticket = jax.device_put(ticket, self.device)
        compiled = program.compiled()
        try:
            outputs, ack = compiled(ticket, args, kwargs)
            jax.block_until_ready((outputs, ack))
        finally:
            failure = self.runtime.take_failure(seq, self.index)
        if failure is not None:
            raise failure
        self.runtime.fire_if_armed(self.index, "result")
        return outputs

    def arm(self, at: str) -> None:
        """Fault injection: this worker fails at point ``at`` of its next step (one shot)."""
        self.runtime.arm(self.index, at)
