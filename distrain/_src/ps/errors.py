"""Errors raised by parameter-server training.

`ClusterCoordinator.join`, `schedule`, `done` and `RemoteValue.fetch` raise
these; the names follow TensorFlow's where TensorFlow has one
(`tf.errors.OutOfRangeError`, `tf.errors.CancelledError`).
"""

from __future__ import annotations


class OutOfRangeError(Exception):
    """A non-repeating per-worker dataset ran out of elements.

    Raised by `join`/`fetch` for the scheduled function that asked for the
    element, as `tf.errors.OutOfRangeError` is in TensorFlow.
    """


class ParameterServerUnavailableError(RuntimeError):
    """A parameter server stopped answering; training cannot continue.

    The variables on it are gone with it. Build a new strategy and
    coordinator and call `ClusterCoordinator.restore(directory)` to resume
    from the latest checkpoint written by `ClusterCoordinator.save`.
    """


class WorkerUnavailableError(RuntimeError):
    """Every worker has failed, so scheduled functions cannot run."""


class FunctionCancelledError(Exception):
    """A scheduled function never ran: an earlier function failed first.

    As in TensorFlow, the first error raised by a scheduled function cancels
    the functions still waiting in the queue; their `RemoteValue.fetch`
    raises this error.
    """


class WorkerFailure(Exception):
    """Internal: the worker running a function died; the function is retried.

    Raised by injected faults (`ClusterCoordinator._inject_worker_failure`)
    and by backends when a worker process disappears. Users never see it: the
    coordinator reschedules the function on another worker.
    """
