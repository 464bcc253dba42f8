"""`ClusterCoordinator`: schedules worker steps, survives worker failures.

TensorFlow's semantics (``tf.distribute.experimental.coordinator``):

* ``schedule(step, args)`` queues a function and returns a `RemoteValue` at
  once; each scheduled function runs at least once, on whichever worker is
  free. Functions start in schedule order (a retried one goes first).
* ``join()`` waits until every scheduled function has finished and every
  pushed gradient is applied; ``done()`` says whether that is the case.
* The first error raised by a scheduled function cancels the functions still
  queued and is re-raised by the next ``schedule``/``join``/``done`` (once).
* ``shutdown()`` resolves every `RemoteValue` (queued ones fail with
  `FunctionCancelledError`); afterwards ``schedule`` and
  ``create_per_worker_dataset`` raise `RuntimeError`, ``join`` returns at once
  and ``done`` is true (nothing can be pending).
* A worker that dies takes no function with it: the function it was running
  is rescheduled on another worker (with the same step number, so servers
  that already got its gradient ignore the second one). A parameter server
  that dies makes every later ``schedule``/``join`` raise
  `ParameterServerUnavailableError`; resume with a new strategy and
  ``restore``.

One driver thread per worker takes functions from the queue. In-process the
driver runs the compiled step itself on its worker's device; with Ray it
calls the worker actor and waits.

Example:
    >>> coordinator = ClusterCoordinator(strategy)
    >>> iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    >>> results = [coordinator.schedule(step, args=(iterator,)) for _ in range(100)]
    >>> coordinator.join()
    >>> results[-1].fetch()

The closures it queues, their queue and the remote values they resolve are
``scheduled_functions.py``'s; they share the coordinator's lock and failure path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from distrain._src.ps import server_checkpoints
from distrain._src.ps.backend import Worker
from distrain._src.ps.errors import (
    FunctionCancelledError,
    ParameterServerUnavailableError,
    WorkerFailure,
    WorkerUnavailableError,
)
from distrain._src.ps.per_worker_datasets import PerWorkerDataset, PerWorkerIterator
from distrain._src.ps.scheduled_functions import Closure, ClosureQueue, RemoteValue
from distrain._src.ps.servers import ServerGroup, check_index
from distrain._src.ps.step import WorkerStep
from distrain._src.ps.worker import FAULT_POINTS

if TYPE_CHECKING:
    from distrain._src.ps.ps_strategy import ParameterServerStrategy

_ADMIT_POLL_S = 0.05


class ClusterCoordinator:
    """Schedules functions built by ``strategy.worker_step`` on the strategy's workers.

    Args:
        strategy: a `ParameterServerStrategy`. A strategy has one coordinator at
            a time; ``shutdown()`` it before making another.

    Raises:
        TypeError: if ``strategy`` is not a `ParameterServerStrategy`.
        ValueError: if the strategy already has a coordinator.
    """

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        from distrain._src.ps.ps_strategy import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                "ClusterCoordinator expects a dt.experimental.ParameterServerStrategy. "
                f"Received: {type(strategy).__name__}."
            )
        strategy.attach_coordinator(self)
        self._strategy = strategy
        self._queue = ClosureQueue()
        self._lock = threading.Lock()
        self._next_seq = 0
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._dataset_fns: dict[int, Callable[..., Any]] = {}
        self._workers: list[Worker] = []
        self._threads: list[threading.Thread] = []
        self._alive: set[int] = set()
        self._counts = {"scheduled": 0, "completed": 0, "retried": 0, "failed": 0, "cancelled": 0}
        self._group: ServerGroup | None = None  # set when the workers start
        self._closed = False

    @property
    def strategy(self) -> ParameterServerStrategy:
        """The strategy whose workers this coordinator schedules on."""
        return self._strategy

    @property
    def _servers(self) -> ServerGroup:
        # Drivers run, and steps fail or finish, only once _ensure_started set the group.
        assert self._group is not None, "the workers have not started"
        return self._group

    # ------------------------------------------------------------------ start
    def _ensure_started(self) -> None:
        if self._group is not None:
            return
        group = self._strategy.server_group("ClusterCoordinator.schedule")
        self._workers = self._strategy.create_workers("ClusterCoordinator.schedule")
        self._alive = set(range(len(self._workers)))
        for worker in self._workers:
            thread = threading.Thread(
                target=self._drive,
                args=(worker,),
                name=f"distrain-worker-{worker.index}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._group = group

    # ------------------------------------------------------------ public API
    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """Makes ``dataset_fn()`` (or ``dataset_fn(dt.InputContext)``) on every worker.

        ``iter()`` the result for a per-worker iterator to pass to ``schedule``.
        Raises:
            RuntimeError: the coordinator was shut down.
        """
        self._check_open("create_per_worker_dataset")
        dataset = PerWorkerDataset(self, dataset_fn)
        self._dataset_fns[dataset.dataset_id] = dataset_fn
        return dataset

    def schedule(
        self, fn: WorkerStep, args: tuple | list = (), kwargs: dict | None = None
    ) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on a worker; returns at once.

        Args:
            fn: a step built by ``strategy.worker_step`` of this coordinator's strategy.
            args: positional arguments: arrays, pytrees of arrays, or per-worker
                iterators (the step receives the worker's next element).
            kwargs: keyword arguments, likewise.

        Returns:
            A `RemoteValue` of the step's outputs.

        Raises:
            TypeError: ``fn`` is not a worker step, or ``args`` is not a tuple.
            ValueError: ``fn`` or an iterator belongs to another strategy/coordinator.
            RuntimeError: the coordinator was shut down.
            Exception: the first error of an earlier function, if not yet raised.
        """
        self._check_open("schedule")
        self._raise_pending()
        if not isinstance(fn, WorkerStep):
            raise TypeError(
                "ClusterCoordinator.schedule expects a step built by strategy.worker_step(fn). "
                f"Received: {getattr(fn, '__qualname__', fn)!r}. Wrap the function: "
                "`step = strategy.worker_step(fn)` where fn(params, *args) returns "
                "(grads, outputs)."
            )
        if fn.strategy is not self._strategy:
            raise ValueError(
                f"{fn!r} was built by another ParameterServerStrategy; build it with "
                "this coordinator's strategy.worker_step(fn)."
            )
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"ClusterCoordinator.schedule expects args as a tuple. Received: "
                f"{type(args).__name__}; write args=(x,)."
            )
        ref_args, ref_kwargs = jax.tree.map(self._to_ref, (tuple(args), dict(kwargs or {})))
        with self._lock:
            # Under the lock shutdown() takes to close: either this step is queued before
            # shutdown() drains the queue (and is cancelled by it), or it is refused here.
            self._check_open("schedule")
            self._ensure_started()
            seq = self._next_seq
            self._next_seq += 1
            self._counts["scheduled"] += 1
            closure = Closure(seq, fn, ref_args, ref_kwargs)
            self._queue.put(closure)
        return closure.value

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"ClusterCoordinator.{what} was called after the coordinator was shut down: its "
                "workers are stopped and nothing would run the function. Create a new "
                "ClusterCoordinator(strategy) (the strategy accepts one once this one is shut "
                "down)."
            )

    def _to_ref(self, leaf: Any) -> Any:
        if isinstance(leaf, PerWorkerDataset):
            raise TypeError(
                "schedule got a per-worker dataset; pass an iterator over it instead: "
                "`iterator = iter(per_worker_dataset)`, then args=(iterator,)."
            )
        if not isinstance(leaf, PerWorkerIterator):
            return leaf
        if leaf.dataset.coordinator is not self:
            raise ValueError(
                "This per-worker iterator was made by another ClusterCoordinator; create the "
                "dataset with this coordinator's create_per_worker_dataset."
            )
        return leaf.ref

    def join(self) -> None:
        """Waits for every scheduled function and every pushed gradient.

        With ``max_staleness=0`` an incomplete synchronous round is applied
        with the gradients it has (as a partial last batch would be). A step
        error is raised once everything that ran is applied.

        Raises:
            Exception: the first error raised by a scheduled function (once).
            ParameterServerUnavailableError: a parameter server is gone.
            WorkerUnavailableError: every worker has failed.
        """
        if self._closed:  # shutdown() resolved every value; the workers are gone
            self._raise_pending()
            return
        if self._group is not None:
            self._queue.wait_idle(lambda: self._fatal is not None)
        if self._group is not None and self._fatal is None:  # the wait may have set it
            # Also after a step error: its round and the gradients of the steps that
            # ran are applied before the error is raised, so the next steps start a
            # fresh round on settled parameters.
            try:
                with self._lock:
                    next_seq = self._next_seq
                next_seq = self._group.flush(next_seq)
                with self._lock:
                    self._next_seq = max(self._next_seq, next_seq)
                self._group.wait_idle()
                self._group.ping()
            except ParameterServerUnavailableError as err:
                self._fatal = err
        self._raise_pending()

    def done(self) -> bool:
        """Whether every scheduled function has finished; raises a pending error."""
        self._raise_pending()
        return self._queue.idle()

    def _raise_pending(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    # ---------------------------------------------------------------- driver
    def _drive(self, worker: Worker) -> None:
        while True:
            closure = self._queue.get()
            if closure is None:
                return
            closure = self._admit(closure)
            if closure is None:  # handed back (shutdown) or failed (reported)
                continue
            try:
                outputs = worker.run(
                    closure.step.program,
                    closure.seq,
                    closure.args,
                    closure.kwargs,
                    self._dataset_fns,
                )
                self._servers.finish(closure.seq)
            except WorkerFailure as err:
                self._worker_died(worker, closure, err)
                return
            except BaseException as err:  # the function's error, reported by join
                self._function_failed(closure, err)
                continue
            with self._lock:
                self._counts["completed"] += 1
            closure.value._set(outputs)
            self._queue.done()

    def _admit(self, closure: Closure) -> Closure | None:
        """Waits until the servers admit a step; runs an earlier retried step meanwhile.

        Returns the step to run, or None if there is none (the coordinator is
        stopping, or the servers failed and the step was reported failed).
        """
        while True:
            try:
                if self._servers.acquire(closure.seq, _ADMIT_POLL_S):
                    return closure
            except BaseException as err:  # a server is gone
                self._function_failed(closure, err)
                return None
            if self._queue.stopped:
                self._queue.put(closure, was_running=True)
                return None
            closure = self._queue.swap_if_earlier(closure)

    def _worker_died(self, worker: Worker, closure: Closure, err: BaseException) -> None:
        if self._queue.stopped:  # shutdown() killed it
            closure.value._fail(FunctionCancelledError("the coordinator was shut down"))
            self._queue.done()
            return
        with self._lock:
            self._alive.discard(worker.index)
            self._counts["retried"] += 1
            alive = len(self._alive)
        try:
            self._servers.release(closure.seq)
        except ParameterServerUnavailableError as ps_err:
            self._function_failed(closure, ps_err)
            return
        if alive:
            self._queue.put(closure, was_running=True)
            return
        self._function_failed(
            closure,
            WorkerUnavailableError(
                f"All {len(self._workers)} workers have failed (the last: {err}); no worker is "
                "left to run scheduled functions. Create a new strategy and coordinator."
            ),
        )

    def _function_failed(self, closure: Closure, err: BaseException) -> None:
        fatal = isinstance(err, ParameterServerUnavailableError | WorkerUnavailableError)
        cancelled = self._queue.drain()
        with self._lock:
            self._counts["failed"] += 1
            self._counts["cancelled"] += len(cancelled)
            if fatal and self._fatal is None:
                self._fatal = err
            elif not fatal and self._error is None and self._fatal is None:
                self._error = err
        for other in cancelled:
            other.value._fail(
                FunctionCancelledError(
                    f"step {other.seq} was cancelled because step {closure.seq} failed first: "
                    f"{type(err).__name__}: {err}"
                )
            )
        if not fatal:
            try:
                self._servers.abandon([closure.seq] + [c.seq for c in cancelled])
            except ParameterServerUnavailableError as ps_err:
                with self._lock:
                    self._fatal = self._fatal or ps_err
        closure.value._fail(err)
        self._queue.done()

    # ---------------------------------------------------------- maintenance
    def save(self, directory: str) -> int:
        """Joins, then writes the servers' params and optimizer state with orbax.

        Returns:
            The step saved: the number of updates applied so far (server 0's version).
        """
        self.join()
        return server_checkpoints.save(self._strategy.server_group("save"), directory)

    def restore(self, directory: str, step: int | None = None) -> int:
        """Loads the servers' params and optimizer state from a checkpoint (latest by default).

        Returns:
            The step restored.

        Raises:
            FileNotFoundError: no checkpoint in ``directory``.
            ValueError: the checkpoint was written for other variables or servers.
        """
        self.join()
        return server_checkpoints.restore(self._strategy.server_group("restore"), directory, step)

    def stats(self) -> dict[str, int]:
        """Scheduled, completed, retried, failed and cancelled functions; live workers."""
        with self._lock:
            return {**self._counts, "workers_alive": len(self._alive)}

    def _inject_worker_failure(self, worker: int, at: str = "pull") -> None:
        """Test hook: ``worker`` dies at ``at`` ("pull", "push", "result") of its next step."""
        self._ensure_started()
        check_index(worker, len(self._workers), "worker")
        if at not in FAULT_POINTS:
            raise ValueError(f"Fault point must be one of {FAULT_POINTS}. Received: at={at!r}.")
        self._workers[worker].arm(at)

    def shutdown(self) -> None:
        """Stops the workers (after their current function); cancels queued functions.

        Idempotent. Afterwards the coordinator accepts no new function.
        """
        with self._lock:
            self._closed = True
        self._queue.stop()
        # Ray workers are killed first, so a driver waiting on one returns at once.
        self._strategy.close_workers(self._workers)
        for thread in self._threads:
            thread.join(timeout=30)
        for closure in self._queue.drain():  # includes steps handed back by drivers
            closure.value._fail(FunctionCancelledError("the coordinator was shut down"))
        self._threads, self._workers = [], []
        self._strategy.detach_coordinator(self)

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
