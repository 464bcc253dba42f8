"""Which strategy is current, and whether code runs per replica or across replicas.

Mirrors ``tf.distribute``'s contexts:

* outside any ``strategy.scope()`` the *default strategy* is current and code runs in
  its (single) replica context;
* inside ``strategy.scope()`` but outside ``strategy.run`` code runs in the
  *cross-replica* context: ``get_replica_context()`` is ``None``;
* inside a function passed to ``strategy.run`` code runs in a *replica context*,
  which offers ``all_reduce`` / ``all_gather`` across the replicas.

The state is thread-local, so each worker thread of the parameter-server mode has
its own. It is the only thread-local state of distrain, and it holds only what
``tf.distribute`` documents as ambient (the current strategy, ``get_replica_context()``):
the loss helpers are called inside user code that receives no other handle on the
replica. What a gradient-accumulation micro-step changes is explicit instead: the
replica context of a micro-step says so (:attr:`ReplicaContext.micro_steps`, read by
``compute_average_loss``), and the state it trains says so (``TrainState.accumulating``,
read by ``apply_gradients``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from distrain._src.cross_device_ops import CrossDeviceOps
    from distrain._src.strategy.base import Strategy


class ReduceOp(enum.Enum):
    """How values from several replicas are combined: ``SUM`` or ``MEAN``."""

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accepts a ``ReduceOp`` or its name (``"sum"``/``"mean"``, any case).

        Raises:
          ValueError: for any other value, listing the valid choices.
        """
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        raise ValueError(
            f"Unknown reduce op: expected one of dt.ReduceOp.SUM, dt.ReduceOp.MEAN, 'sum' or "
            f"'mean'. Received: op={op!r}."
        )


class _State(threading.local):
    def __init__(self) -> None:
        self.strategies: list[Strategy] = []
        self.replica: ReplicaContext | None = None


_state = _State()

# The default strategy's factory, registered by strategy/one_device.py as it loads
# (``import distrain`` loads it): this module, which every strategy imports, imports none.
_default_factory: list[Callable[[], Strategy]] = []


def register_default_strategy(factory: Callable[[], Strategy]) -> None:
    """Sets what ``get_strategy()`` returns outside every scope."""
    _default_factory[:] = [factory]


def _default_strategy() -> Strategy:
    return _default_factory[0]()


@dataclasses.dataclass(frozen=True)
class MicroSteps:
    """One optimizer update split into micro-steps (``dt.accumulate_gradients``).

    Attributes:
      steps: micro-steps per update (``k``).
      mask_key: the batch key of the 0/1 mask of real rows.
      mask_total: real rows of the whole update summed over micro-steps and replicas,
        or ``None`` when the batch has no mask.
    """

    steps: int
    mask_key: str | None
    mask_total: jax.Array | None

    def require_mask_total(self, where: str) -> jax.Array:
        """``mask_total``, or a ValueError naming ``where`` when the batch had no mask."""
        if self.mask_total is None:
            raise ValueError(
                f"`{where}` under gradient accumulation divides by the number of real rows "
                f"of the whole update, read from the batch key {self.mask_key!r}, which this "
                "batch does not have. Put the mask in the batch under that key (the "
                "Trainer's `mask_key`), or pass `global_batch_size`."
            )
        return self.mask_total


class ReplicaContext:
    """The context of one replica inside ``strategy.run``.

    Its collectives run across all replicas of the strategy. Values are pytrees.

    Example:
      >>> def step(x):
      ...     ctx = dt.get_replica_context()
      ...     return ctx.all_reduce("sum", x)
    """

    def __init__(
        self,
        strategy: Strategy,
        axis_name: str | None,
        cross_device_ops: CrossDeviceOps | None = None,
        replica_id: jax.Array | None = None,
        elide_collectives: bool = False,
        *,
        num_replicas: int | None = None,
    ) -> None:
        self._strategy = strategy
        # The replicas the collectives run over: the strategy's, or its group's (islands).
        self._num_replicas = num_replicas
        self._axis_name = axis_name
        self._cross_device_ops = cross_device_ops
        self._replica_id = replica_id
        # One replica spanning devices: its all-reduce and all-gather are the value
        # itself, and XLA rejects an all-reduce over a manual axis of size 1.
        self._elide = elide_collectives
        self._micro_steps: MicroSteps | None = None
        # The loss shares computed in this context, while a step is traced (see
        # _recording_shares below).
        self._shares: dict[int, tuple[Any, float]] | None = None

    def _derive(self, **attrs: Any) -> ReplicaContext:
        """A copy with some private attributes replaced (entered with ``_enter_replica``)."""
        ctx = copy.copy(self)
        for name, value in attrs.items():
            setattr(ctx, name, value)
        return ctx

    def with_micro_steps(self, micro_steps: MicroSteps) -> ReplicaContext:
        """This context for one micro-step of ``micro_steps`` (``dt.accumulate_gradients``)."""
        return self._derive(_micro_steps=micro_steps)

    @property
    def micro_steps(self) -> MicroSteps | None:
        """The gradient accumulation this replica runs a micro-step of, or ``None``.

        ``compute_average_loss`` reads it to divide by the whole update's batch.
        """
        return self._micro_steps

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def axis_name(self) -> str | None:
        """The mesh axis the collectives run over (``None`` for the default strategy)."""
        return self._axis_name

    @property
    def num_replicas_in_sync(self) -> int:
        """The replicas this replica's collectives run over (an island's, under DiLoCo)."""
        if self._num_replicas is not None:
            return self._num_replicas
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> jax.Array | int:
        """This replica's index in ``0 .. num_replicas_in_sync - 1`` (traced under ``run``)."""
        if self._axis_name is None:
            return 0
        if self._replica_id is not None:  # given as an input (replicas that span devices)
            return self._replica_id
        return jax.lax.axis_index(self._axis_name)

    def all_reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Sums (or averages) ``value`` over all replicas; every replica gets the result."""
        op = ReduceOp.parse(op)
        if self._axis_name is None or self._elide:
            return value
        if self._cross_device_ops is None:
            summed = jax.lax.psum(value, self._axis_name)
        else:
            summed = self._cross_device_ops.all_sum(value, self._axis_name)
        if op is ReduceOp.MEAN:
            n = self.num_replicas_in_sync
            summed = jax.tree.map(lambda x: x / jnp.asarray(n, x.dtype), summed)
        return summed

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates every replica's ``value`` along ``axis``, in replica order."""
        if self._axis_name is None or self._elide:
            return value
        return jax.tree.map(
            lambda x: jax.lax.all_gather(x, self._axis_name, axis=axis, tiled=True), value
        )


def current_strategy() -> Any:
    """The strategy of the innermost ``scope()``, else the default (one replica) strategy
    (``dt.get_strategy()``, typed, is ``current.py``'s: this module names no strategy
    class, so that the strategies and the parameter-server package can import it)."""
    if _state.strategies:
        return _state.strategies[-1]
    return _default_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy's ``scope()`` is active."""
    return bool(_state.strategies)


def in_cross_replica_context() -> bool:
    """True inside a strategy's scope but outside ``strategy.run``."""
    return has_strategy() and _state.replica is None


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, or ``None`` in the cross-replica context.

    Outside any scope this is the default strategy's single replica context.
    """
    if _state.replica is not None:
        return _state.replica
    if has_strategy():
        return None
    return ReplicaContext(_default_strategy(), axis_name=None)


@contextmanager
def _enter_scope(strategy: Strategy) -> Iterator[Strategy]:
    current = _state.strategies[-1] if _state.strategies else None
    if current is not None and current is not strategy:
        raise RuntimeError(
            f"Cannot enter {type(strategy).__name__}.scope() inside the scope of another "
            f"strategy ({type(current).__name__}). Expected at most one strategy per scope "
            "stack; exit the outer scope first."
        )
    _state.strategies.append(strategy)
    try:
        yield strategy
    finally:
        _state.strategies.pop()


@contextmanager
def _enter_replica(ctx: ReplicaContext | None) -> Iterator[ReplicaContext | None]:
    previous = _state.replica
    _state.replica = ctx
    try:
        yield ctx
    finally:
        _state.replica = previous


def require_cross_replica(strategy: Strategy, method: str) -> None:
    """Raises if a cross-replica-only ``method`` is called inside ``strategy.run``."""
    if _state.replica is not None and _state.replica.axis_name is not None:
        raise RuntimeError(
            f"`{type(strategy).__name__}.{method}` is a cross-replica method and cannot be "
            "called inside `strategy.run`. Use `dt.get_replica_context()` (all_reduce, "
            "all_gather) inside the replica function, or call it outside `run`."
        )


# The value of `compute_average_loss` (or `scale_regularization_loss`) is this replica's
# *share* of the global mean loss: summing it over replicas (and micro-steps) gives the
# mean, averaging does not.
# While the Trainer traces a step it records those values, so that a step returning one
# as a plain scalar metric has it logged as the global mean (`metrics.normalize`).
# Recognition is by identity: the returned tracer, or what `jax.value_and_grad` /
# `jax.grad(has_aux=True)` hands back for it (the tracer's `primal`).


def _primal_chain(value: Any) -> Iterator[Any]:
    while isinstance(value, jax.core.Tracer):
        yield value
        value = getattr(value, "primal", None)


@contextmanager
def _recording_shares() -> Iterator[None]:
    """Records the ``compute_average_loss`` values computed inside (see ``share_count``).

    The record belongs to a copy of the current replica context, entered for the block
    (in the cross-replica context no loss share can be computed, so there is none).
    """
    ctx = get_replica_context()
    with _enter_replica(ctx._derive(_shares={}) if ctx is not None else None):
        yield


def _record_share(value: Any, count: float) -> None:
    """Notes that ``value`` is a share whose ``count`` summed over the parts gives 1."""
    shares = _state.replica._shares if _state.replica is not None else None
    if shares is not None:
        for v in _primal_chain(value):
            shares[id(v)] = (v, count)


def share_count(value: Any) -> float | None:
    """``1 / (replicas x micro-steps)`` if ``value`` is a recorded share, else ``None``."""
    shares = _state.replica._shares if _state.replica is not None else None
    if shares:
        for v in _primal_chain(value):
            hit = shares.get(id(v))  # the dict keeps each value alive: its id is its own
            if hit is not None:
                return hit[1]
    return None
