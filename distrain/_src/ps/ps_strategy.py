"""`ParameterServerStrategy`: variables on parameter servers, asynchronous workers.

The strategy owns the parameter servers and says how workers run; the
`ClusterCoordinator` (``cluster_coordinator.py``) schedules steps on them. Three
calls set it up:

* ``create_variables(params, tx)`` places a params pytree and its optax
  optimizer on the servers (cut by ``variable_partitioner``, see
  ``layout.py``);
* ``worker_step(fn)`` turns ``fn(params, *args) -> (grads, outputs)`` into a
  step the coordinator can schedule (``step.py``);
* ``read_variables()`` returns the current params.

``max_staleness`` chooses the consistency: None applies every gradient as it
arrives (asynchronous SGD); ``k > 0`` lets at most ``k`` updates land between
a step's pull and the application of its gradient (workers wait when needed);
``0`` is synchronous: each round of ``num_workers`` steps is averaged and
applied as one update, which reproduces synchronous data-parallel SGD.

Example:
    >>> strategy = dt.experimental.ParameterServerStrategy(num_workers=4, num_ps=2)
    >>> variables = strategy.create_variables(params, optax.adam(1e-3))
    >>> step = strategy.worker_step(step_fn)
    >>> coordinator = dt.experimental.coordinator.ClusterCoordinator(strategy)
    >>> for batch in batches:
    ...     coordinator.schedule(step, args=(batch,))
    >>> coordinator.join()
    >>> params = variables.read()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

from distrain._src import context
from distrain._src.ps.backend import ServerBackend, Worker
from distrain._src.ps.servers import ServerGroup, check_index
from distrain._src.ps.step import StepFn, WorkerStep
from distrain._src.ps.variable_layout import Layout

if TYPE_CHECKING:
    from distrain._src.ps.cluster_coordinator import ClusterCoordinator

BACKENDS = ("inprocess", "ray")


class ShardedVariables:
    """Handle on the variables of a `ParameterServerStrategy`.

    Attributes:
        placement: ``(leaf path, server, rows or None)`` for every piece.
    """

    def __init__(self, strategy: ParameterServerStrategy, layout: Layout):
        self._strategy = strategy
        self.placement = layout.describe()

    def read(self) -> Any:
        """The current params pytree (NumPy arrays), after every pushed gradient."""
        return self._strategy.read_variables()

    def __repr__(self) -> str:
        return f"ShardedVariables({len(self.placement)} pieces on {self._strategy.num_ps} servers)"


def _check_count(name: str, value: Any, allow_none: bool, minimum: int = 1) -> None:
    ok = (value is None and allow_none) or (
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    )
    if not ok:
        none = "None or " if allow_none else ""
        raise ValueError(
            f"ParameterServerStrategy({name}) expects {none}an integer >= {minimum}. "
            f"Received: {name}={value!r}."
        )


class ParameterServerStrategy:
    """Data-parallel training against parameter servers, TensorFlow-style.

    Args:
        num_workers: workers running steps. Default: one per local device
            (in-process), or one per CPU of the Ray cluster.
        num_ps: parameter servers the variables are spread over.
        variable_partitioner: callable ``(shape, dtype) -> counts per axis``
            (e.g. ``dt.experimental.partitioners.FixedShardsPartitioner(2)``),
            or None to keep every variable whole.
        backend: ``"inprocess"`` (servers are objects, workers are threads)
            or ``"ray"`` (servers and workers are Ray actors; extra ``ray``).
        ray_address: Ray cluster to join (``"host:port"``, ``"ray://host:port"``
            or ``"auto"``); None starts a local instance bound to 127.0.0.1.
        max_staleness: None (asynchronous), 0 (synchronous rounds), or the
            largest number of updates allowed between a step's pull and the
            application of its gradient.

    Raises:
        ValueError: an unknown backend, a count below its minimum, or
            ``ray_address`` without the Ray backend.
        TypeError: a ``variable_partitioner`` that is not callable.
        ConnectionError: ``ray_address`` cannot be reached.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        num_ps: int = 1,
        variable_partitioner: Callable[[Sequence[int], np.dtype], Sequence[int]] | None = None,
        backend: str = "inprocess",
        ray_address: str | None = None,
        max_staleness: int | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(
                f"ParameterServerStrategy(backend) must be one of {BACKENDS}. "
                f"Received: backend={backend!r}."
            )
        _check_count("num_workers", num_workers, allow_none=True)
        _check_count("num_ps", num_ps, allow_none=False)
        _check_count("max_staleness", max_staleness, allow_none=True, minimum=0)
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "ParameterServerStrategy(variable_partitioner) expects None or a callable "
                "(shape, dtype) -> partitions per axis, such as "
                "dt.experimental.partitioners.FixedShardsPartitioner(2). "
                f"Received: {variable_partitioner!r}."
            )
        if backend == "inprocess":
            if ray_address is not None:
                raise ValueError(
                    "ParameterServerStrategy(ray_address) only applies to backend='ray'. "
                    f"Received: ray_address={ray_address!r} with backend='inprocess'."
                )
            from distrain._src.ps.inprocess import InProcessBackend

            self._backend: ServerBackend = InProcessBackend()
        else:
            from distrain._src.ps.ray_backend import RayBackend

            self._backend = RayBackend(ray_address)
        self.backend = backend
        self.num_workers = num_workers or self._backend.default_num_workers()
        self.num_ps = num_ps
        self.variable_partitioner = variable_partitioner
        self.max_staleness = max_staleness
        self._group: ServerGroup | None = None
        self._coordinator: ClusterCoordinator | None = None

    @property
    def num_replicas_in_sync(self) -> int:
        """1: each worker step is its own replica, as in TensorFlow's strategy."""
        return 1

    def scope(self) -> AbstractContextManager[ParameterServerStrategy]:
        """Makes this the current strategy (``dt.get_strategy()``) inside a ``with``."""
        # The ignore: this strategy is duck-typed against Strategy (the same scope API,
        # not a subclass), and the scope stack holds it as one.
        return context._enter_scope(self)  # type: ignore[arg-type, return-value]

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(num_workers={self.num_workers}, num_ps={self.num_ps}, "
            f"backend={self.backend!r}, max_staleness={self.max_staleness})"
        )

    # ------------------------------------------------------------- variables
    def create_variables(self, params: Any, tx: optax.GradientTransformation) -> ShardedVariables:
        """Places ``params`` and the state of optimizer ``tx`` on the parameter servers.

        Args:
            params: pytree of arrays (the initial parameters).
            tx: optax optimizer. Each server applies it to its own pieces, so
                use an elementwise one (sgd, adam, ...): a transformation that
                looks at all parameters at once (``clip_by_global_norm``)
                would see one server's pieces only.

        Returns:
            A `ShardedVariables` handle.

        Raises:
            ValueError: variables already exist, or the partitioner produced no shards.
            TypeError: ``tx`` is not an optax transformation.
        """
        if self._group is not None:
            raise ValueError(
                "This ParameterServerStrategy already has variables; create one strategy per "
                "model (or restore into the existing variables with coordinator.restore)."
            )
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                "create_variables expects an optax.GradientTransformation as tx (e.g. "
                f"optax.adam(1e-3)). Received: {type(tx).__name__}."
            )
        from distrain._src.train.state import TrainState

        if isinstance(params, TrainState):
            raise TypeError(
                "create_variables expects the parameters, not a dt.TrainState: pass "
                "state.params (the servers create and update the optimizer state). A "
                "TrainState's mixed-precision policy and loss scale do not apply here: "
                "the servers update float32 parameters; cast inside the worker step to "
                "compute in bfloat16, and accumulate micro-batches there if needed."
            )
        layout = Layout.plan(params, self.num_ps, self.variable_partitioner)
        pieces = layout.split([np.asarray(x) for x in jax.tree.leaves(params)])
        self._group = self._backend.create_group(
            layout, pieces, tx, self.num_workers, self.max_staleness
        )
        return ShardedVariables(self, layout)

    # ------------------------------------------- for the coordinator and worker steps
    # Internal (not TensorFlow API): what `ClusterCoordinator` and `WorkerStep` need
    # of the strategy, so that neither reads its attributes.
    def server_group(self, what: str) -> ServerGroup:
        """The parameter servers as one client; ``what`` names the caller in the error.

        Raises:
            RuntimeError: ``create_variables`` was not called yet.
        """
        if self._group is None:
            raise RuntimeError(
                f"{what} needs the variables: call strategy.create_variables(params, tx) first."
            )
        return self._group

    def attach_coordinator(self, coordinator: ClusterCoordinator) -> None:
        """Records ``coordinator`` as this strategy's one coordinator.

        Raises:
            ValueError: the strategy already has a coordinator.
        """
        if self._coordinator is not None:
            raise ValueError(
                "This ParameterServerStrategy already has a ClusterCoordinator. Use it, or call "
                "its shutdown() before creating another."
            )
        self._coordinator = coordinator

    def detach_coordinator(self, coordinator: ClusterCoordinator) -> None:
        """Forgets ``coordinator`` (after its shutdown), so that another may attach."""
        if self._coordinator is coordinator:
            self._coordinator = None

    def create_workers(self, what: str) -> list[Worker]:
        """Starts a session on the servers and ``num_workers`` workers talking to them."""
        group = self.server_group(what)
        group.start_session()
        return self._backend.create_workers(group, self.num_workers)

    def close_workers(self, workers: list[Worker]) -> None:
        """Stops workers made by `create_workers`."""
        self._backend.close_workers(workers)

    def worker_step(self, fn: StepFn) -> WorkerStep:
        """Builds a step to schedule: ``fn(params, *args, **kwargs) -> (grads, outputs)``.

        ``params`` is the pytree pulled from the servers at the start of the
        step; ``grads`` must have its structure and shapes; ``outputs`` (any
        pytree of arrays, or None) is what ``RemoteValue.fetch()`` returns.

        Example:
            >>> def step_fn(params, batch):
            ...     loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            ...     return grads, {"loss": loss}
            >>> step = strategy.worker_step(step_fn)
        """
        return WorkerStep(self, fn)

    def read_variables(self) -> Any:
        """The current params pytree (NumPy arrays), after every pushed gradient."""
        group = self.server_group("read_variables")
        group.wait_idle()
        return group.layout.unflatten(group.read())

    def stats(self) -> list[dict[str, Any]]:
        """Per server: gradients pushed, duplicates ignored, applied, abandoned; version;
        pending updates; largest and mean staleness of the applied gradients."""
        return self.server_group("stats").stats()

    def _inject_ps_failure(self, index: int) -> None:
        """Test hook: parameter server ``index`` dies (in-process) or is killed (Ray)."""
        group = self.server_group("_inject_ps_failure")
        check_index(index, self.num_ps, "parameter server")
        group.fail(index)

    def shutdown(self) -> None:
        """Stops the coordinator, the workers and the parameter servers."""
        if self._coordinator is not None:
            self._coordinator.shutdown()
        if self._group is not None:
            self._group.shutdown()
        self._backend.shutdown()
