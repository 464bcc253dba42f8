"""The strategy interface: the tf.distribute surface over a replica layout.

Who owns what (one concept per module):

* ``Strategy`` (this module) is the abstract interface users program against: the
  tf.distribute methods (``run``, ``reduce``, ``gather``, ``experimental_local_results``,
  the distribute methods) and the hook :meth:`Strategy.state_sharding` each concrete
  strategy fills (from its layout).
* ``replica_layout.ReplicaLayout`` owns *where* values live: the mesh (one replica per
  device, or a named mesh of devices per replica, ``replica_mesh.py``), the state's
  layout (``layout.py``), the batches' (``batch_layout.py``) and placement. A strategy
  composes one (``strategy.replica_layout``).
* ``_compiler.ReplicaCompiler`` compiles and dispatches replica functions (``run``); a
  strategy owns one and delegates to it.
* ``_cross_replica`` holds reduce / gather; ``_checks`` the argument and trace-time
  checks; ``_replication`` which outputs are identical on every replica;
  ``distrain._src.data`` turns datasets into per-replica batches.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from distrain._src import context
from distrain._src.context import ReduceOp
from distrain._src.cross_device_ops import CrossDeviceOps, resolve
from distrain._src.data.distributed import DistributedDataset, from_function
from distrain._src.data.placement import shard_global_batch
from distrain._src.strategy import _checks, replica_mesh, sharded
from distrain._src.strategy import _cross_replica as xr
from distrain._src.strategy import layout as _layout
from distrain._src.strategy import rules as _rules
from distrain._src.strategy._checks import check_placeable
from distrain._src.strategy._compiler import ReplicaCompiler
from distrain._src.strategy.replica_layout import REPLICA_AXIS, ReplicaLayout, is_abstract
from distrain._src.values import PerReplica

__all__ = ["Strategy", "check_placeable"]


class Strategy(abc.ABC):
    """Abstract base of all synchronous strategies: replicas on the devices of a mesh.

    Concrete strategies choose devices and fill :meth:`state_sharding` (from their
    :class:`ReplicaLayout`, built from the layout keywords below); everything else
    derives from the layout's mesh.

    Args:
      devices: the devices, in replica order.
      cross_device_ops: how replicas sum values (default :class:`dt.AllReduce`).
      max_in_flight: how many ``run`` calls may be queued before the host waits for the
        oldest (bounded: an unbounded queue of collectives deadlocks on CPU).
      devices_per_replica, layout, logical_axis_rules, batch_layout, min_shard_bytes,
        shard_state, replica_groups, state_device: where values live, as
        :class:`ReplicaLayout` takes them (``strategy.replica_layout``).
    """

    axis_name = REPLICA_AXIS
    inner_axis_name = replica_mesh.INNER_AXIS

    def __init__(
        self,
        devices: Sequence[jax.Device],
        cross_device_ops: CrossDeviceOps | None = None,
        *,
        max_in_flight: int = 2,
        devices_per_replica: replica_mesh.DevicesPerReplica = 1,
        layout: _rules.LayoutRules | None = None,
        logical_axis_rules: _rules.LogicalAxisRules | None = None,
        batch_layout: _rules.LayoutRules | None = None,
        min_shard_bytes: int = sharded.DEFAULT_MIN_SHARD_BYTES,
        shard_state: bool | str = False,
        replica_groups: tuple[str, int] | None = None,
        state_device: jax.Device | None = None,
    ) -> None:
        self._placement = ReplicaLayout(
            devices,
            devices_per_replica=devices_per_replica,
            layout=layout,
            logical_axis_rules=logical_axis_rules,
            batch_layout=batch_layout,
            min_shard_bytes=min_shard_bytes,
            shard_state=shard_state,  # type: ignore[arg-type]
            replica_groups=replica_groups,
            state_device=state_device,
        )
        # The mesh and the shardings the compiler and the cross-replica kernels use.
        self._devices = self._placement.devices
        self._mesh = self._placement.mesh
        self._replicated = self._placement.replicated
        self._stacked = self._placement.stacked
        self._cross_device_ops = resolve(cross_device_ops)
        self._compiler = ReplicaCompiler(self, max_in_flight)

    @property
    def replica_layout(self) -> ReplicaLayout:
        """Where this strategy's values live: the mesh, the state's and the batches'
        shardings, and placement (:class:`dt.ReplicaLayout`)."""
        return self._placement

    def memory_report(self, tree: Any) -> dict[str, int]:
        """Bytes of ``tree``'s arrays per device (``"bytes_per_device"``) and of one full
        copy (``"bytes_full_copy"``), with the counts of sharded and replicated leaves.

        Example:
          >>> strategy.memory_report(state)["bytes_per_device"]
        """
        return sharded.memory_report(tree)

    # ------------------------------------------------------------ layout hook
    @abc.abstractmethod
    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        """Where a state leaf of this shape lives: what ``put_replicated`` places it on,
        and where ``run`` returns a result of this shape that is identical on every
        replica (a full copy per replica, one slice per replica, split over a replica's
        devices, or another device). ``path`` is the leaf's key path
        (``"params/dense/kernel"``), which layout rules match."""

    # ------------------------------------------------------------------ basics
    @property
    def mesh(self) -> Mesh:
        """The device mesh: one axis ``strategy.axis_name`` (a replica per device), or
        ``(axis_name, *inner_axes)`` when a replica spans devices."""
        return self._mesh

    @property
    def inner_axes(self) -> dict[str, int]:
        """A replica's named mesh, ``{axis: size}`` (empty: one replica per device).

        Example:
          >>> dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2}).inner_axes
          {'fsdp': 4, 'tensor': 2}
        """
        return self._placement.inner_axes

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    @property
    def num_replicas_in_sync(self) -> int:
        return self._placement.num_replicas

    @property
    def devices_per_replica(self) -> int:
        """How many devices each replica spans (1: one replica per device)."""
        return self._placement.devices_per_replica

    def replica_devices(self, replica_id: int) -> tuple[jax.Device, ...]:
        """The devices of replica ``replica_id`` (neighbours, in mesh order)."""
        return self._placement.replica_devices(replica_id)

    @property
    def is_chief(self) -> bool:
        """Whether this process prints progress and writes logs (process 0)."""
        return jax.process_index() == 0

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._cross_device_ops

    def scope(self) -> AbstractContextManager[Strategy]:
        """Makes this the current strategy (``dt.get_strategy()``) inside a ``with``."""
        return context._enter_scope(self)

    def __repr__(self) -> str:
        inner = self._placement.inner_axes
        extra = (
            ""
            if not inner
            else f", devices_per_replica={self.devices_per_replica}"
            if list(inner) == [self.inner_axis_name]
            else f", devices_per_replica={inner}"
        )
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}{extra})"

    # -------------------------------------------------------------- placement
    def put_replicated(self, tree: Any) -> Any:
        """Places a pytree (e.g. the initial train state) where this strategy keeps state.

        The result shares no buffer with ``tree``: a step that donates it
        (``run(..., donate_argnums=...)``) leaves the caller's arrays intact. Only the
        JAX arrays already on one of the strategy's devices are copied for that (JAX
        would otherwise reuse their buffers there); the rest are transferred as usual. A
        tree of ``jax.ShapeDtypeStruct`` gets the shardings state would have.

        Raises:
          TypeError: a leaf that is not an array or a number (the message names it).
        """
        abstract = is_abstract(tree)
        tree = tree if abstract else check_placeable(tree)
        self._placement.check_rules_used(tree)
        place = self._placement.place_abstract if abstract else self._placement.place_state
        return place(tree)

    def state_shardings(self, tree: Any) -> Any:
        """:meth:`state_sharding` for each leaf of ``tree`` (by shape and key path)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.state_sharding(np.shape(x), _layout.path_str(path)), tree
        )

    def memory_analysis(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        *,
        donate_argnums: int | Sequence[int] = (),
    ) -> dict[str, int]:
        """Per-device bytes of ``strategy.run(fn, args, kwargs, donate_argnums=...)``'s
        program, compiled, not run.

        Tells whether a step fits on the devices before running it. From XLA's
        compiled memory analysis: ``argument_bytes`` (inputs: state, batch),
        ``output_bytes``, ``temp_bytes`` (activations, gradients, workspace),
        ``alias_bytes`` (outputs that reuse donated inputs) and ``peak_bytes`` =
        argument + output + temp - alias (XLA:CPU's own peak leaves temporaries out):
        pass the ``donate_argnums`` the step runs with (the Trainer donates the state,
        ``0``), else the new state counts twice. Not counted: what lives outside the
        program (other arrays, prefetched batches, the allocator's fragmentation).

        The arguments may be abstract (``jax.ShapeDtypeStruct`` trees, e.g. from
        ``jax.eval_shape``): then nothing is allocated, so a model that would not fit
        can be asked about. An abstract state leaf without a sharding is laid out as
        ``put_replicated`` would place it; an abstract batch is one
        ``distribute_batch`` made of ``ShapeDtypeStruct`` rows.

        Example:
          >>> strategy.memory_analysis(train_step, args=(state, batch), donate_argnums=0)
          >>> abstract = jax.eval_shape(make_state)           # allocates nothing
          >>> batch = strategy.distribute_batch(jax.ShapeDtypeStruct((64, 512), jnp.int32))
          >>> strategy.memory_analysis(train_step, args=(abstract, batch))["peak_bytes"]
        """
        m = self.compile(fn, args, kwargs, donate_argnums=donate_argnums).memory_analysis()
        parts = {
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes),
        }
        peak = parts["argument_bytes"] + parts["output_bytes"] + parts["temp_bytes"]
        return {**parts, "peak_bytes": peak - parts["alias_bytes"]}

    def compile(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        *,
        donate_argnums: int | Sequence[int] = (),
    ) -> Any:
        """The compiled XLA program ``run(fn, args, kwargs, donate_argnums=...)`` would
        execute, not run: a ``jax.stages.Compiled`` (``as_text()`` for its optimized HLO,
        ``cost_analysis()``, ``memory_analysis()``). Abstract arguments are placed as in
        :meth:`memory_analysis`.

        Example:
          >>> hlo = strategy.compile(train_step, args=(state, batch)).as_text()
        """
        context.require_cross_replica(self, "compile")
        args, kwargs, donate = _checks.check_run_arguments(fn, args, kwargs, donate_argnums)
        fn, args, kwargs = self._prepare_call(fn, tuple(args), kwargs or {})
        placed, kw = self._placement.place_abstract((args, kwargs))
        return self._compiler.compile(fn, placed, kw, donate)

    def eval_shape(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        """The shapes and dtypes of one replica's results of ``run(fn, args, kwargs)``,
        traced as ``run`` traces it; nothing is compiled or run (``jax.eval_shape``).

        Example:
          >>> strategy.eval_shape(train_step, args=(state, batch))[1]   # the metrics
        """
        context.require_cross_replica(self, "eval_shape")
        args, kwargs, _ = _checks.check_run_arguments(fn, args, kwargs, ())
        fn, call_args, kwargs = self._prepare_call(fn, tuple(args), kwargs or {})
        return self._compiler.output_shapes(fn, call_args, kwargs)

    # Hooks for a strategy whose state wraps the user's (DiLoCo's islands): the
    # identity here.
    def _prepare_call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
        """What the compiler runs for ``run(fn, args, kwargs)``."""
        return fn, args, kwargs

    def training_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """The function a training loop calls once per batch in its replica function
        (several calls per ``run`` when it fuses steps): ``step`` itself, unless the
        strategy adds work to every step (DiLoCo: the outer step after every H-th).

        Example:
          >>> inner = strategy.training_step(train_step)
          >>> def two_steps(state, b1, b2):
          ...     return inner(inner(state, b1)[0], b2)
        """
        return step

    def evaluation_state(self, state: Any) -> Any:
        """The state that evaluation and prediction steps receive: ``state`` itself,
        unless the strategy's state wraps the user's (DiLoCo: the global model)."""
        return state

    def batch_sharding(self, rows: int) -> NamedSharding:
        """Where a global batch of ``rows`` rows lives (:meth:`ReplicaLayout.batch_sharding`)."""
        return self._placement.batch_sharding(rows)

    def distribute_batch(self, batch: Any) -> PerReplica:
        """Splits one global batch (a pytree of arrays) across the replicas, in order.

        A batch of ``jax.ShapeDtypeStruct`` leaves gives an abstract per-replica batch
        (nothing allocated) for :meth:`memory_analysis`.
        """
        abstract = self._placement.abstract_batch(batch)
        if abstract is not None:
            return PerReplica(abstract, self.num_replicas_in_sync)
        return shard_global_batch(self, batch)

    # -------------------------------------------------------------------- run
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        *,
        donate_argnums: int | Sequence[int] = (),
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per replica, compiled.

        ``dt.PerReplica`` arguments (batches of a distributed dataset) are split: each
        replica gets its own part. Arrays are broadcast to every replica; other Python
        values are compile-time constants. Outputs identical on all replicas (for
        example the state after ``apply_gradients``) are returned as mirrored arrays
        (one copy, placed like the state); the rest as ``dt.PerReplica`` leaves. Both
        reduce as in TensorFlow (see :meth:`reduce`).

        ``donate_argnums`` (a JAX extension of TF's signature) names positional ``args``
        whose arrays XLA may reuse for the outputs, as ``jax.jit`` does: the caller must
        not use those arrays afterwards. It saves a copy of the state per step.

        Raises:
          TypeError: ``fn`` not callable, ``args`` not a tuple/list, ``kwargs`` not a
            mapping, unhashable constants, an output that is not an array pytree.
          RuntimeError: ``fn`` stored traced values in global variables or changed its
            arguments in place (a TF-style step: return the new state instead).
          ValueError: a per-replica value of another strategy; ``fn`` reads arrays placed
            by the strategy from globals instead of taking them as arguments.

        Example:
          >>> def step(state, batch):
          ...     loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
          ...     return state.apply_gradients(grads=grads), loss
          >>> state, loss = strategy.run(step, args=(state, dist_batch))
        """
        context.require_cross_replica(self, "run")
        if (
            type(args) is not tuple
            or type(donate_argnums) is not tuple
            or (kwargs is not None and type(kwargs) is not dict)
            or not callable(fn)
        ):
            args, kwargs, donate_argnums = _checks.check_run_arguments(
                fn, args, kwargs, donate_argnums
            )
        return self._compiler.run(fn, args, kwargs or {}, donate_argnums)

    # ---------------------------------------------------------- cross-replica
    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines the replicas' values of a result of ``run`` into one (replicated) value.

        As in TensorFlow, everything ``run`` returns is a distributed value: a
        ``dt.PerReplica`` (one component per replica) or a *mirrored* array (identical on
        every replica: the strategy keeps one copy). ``SUM`` adds the replicas'
        components, so a mirrored value ``v`` sums to ``num_replicas_in_sync * v``;
        ``MEAN`` averages them. With ``axis``, each component is also reduced over that
        axis (``MEAN`` then averages over all elements of the global batch). ``value`` may
        be any pytree of such values (a metrics object, a dict of losses).

        Raises:
          ValueError: ``SUM`` of an array that ``run`` did not return (it has no
            replicas: TensorFlow raises too), or an ``axis`` the components do not have.
          TypeError: a non-integer ``axis``.

        Example:
          >>> strategy.reduce("sum", strategy.run(lambda: jnp.float32(1)))  # 8.0 on 8 replicas
        """
        context.require_cross_replica(self, "reduce")
        return xr.reduce_tree(self, ReduceOp.parse(op), value, axis)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates the per-replica components of ``value`` along ``axis``, in replica order.

        ``value`` may be any pytree of results of ``run`` or distributed batches. A
        mirrored array contributes one copy per replica, as in TensorFlow.

        Raises:
          ValueError: an ``axis`` the components do not have.
          TypeError: a non-integer ``axis``.
        """
        context.require_cross_replica(self, "gather")
        return xr.gather_tree(self, value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this process's replicas, in replica order.

        A replica that spans processes is local to each of them: its component of a
        result of ``run`` is whole on every device of the replica, so each process gets
        all of it; of a distributed batch, each process gets the rows it fed.
        """
        context.require_cross_replica(self, "experimental_local_results")
        return xr.local_components(self._placement.local_replicas(), value)

    # ---------------------------------------------------------------- inputs
    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None):
        """Wraps an iterable of *global* batches; iterating it yields per-replica batches.

        Accepts NumPy/JAX pytrees, grain datasets and loaders, and ``dt.data.ArrayPipeline``.
        On several processes each process reads only its own slice of every batch.
        """
        context.require_cross_replica(self, "experimental_distribute_dataset")
        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options=None):
        """Calls ``dataset_fn(dt.InputContext)`` on each process; it yields that process's
        rows, or, with ``dt.InputOptions(per_replica_batches=True)`` (TF's form, batched
        by ``ctx.get_per_replica_batch_size``), one per-replica batch per local replica
        and step. Every process must yield the same number of rows per step."""
        context.require_cross_replica(self, "distribute_datasets_from_function")
        return from_function(self, dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]):
        """Builds a ``PerReplica`` from ``value_fn(ctx)`` called once per local replica.

        ``ctx`` has ``replica_id_in_sync_group`` and ``num_replicas_in_sync``.

        Raises:
          ValueError: the replicas' values differ in structure or in a leaf's shape.
          TypeError: a leaf that cannot go to a device (a string or object array).
        """
        return xr.stacked_values(self._placement, self.num_replicas_in_sync, value_fn)
