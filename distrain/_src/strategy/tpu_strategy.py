"""``TPUStrategy``: MultiWorkerMirroredStrategy over the chips of a TPU slice, in TF's spellings.

Construction checks that this machine has TPUs (one clear error before anything starts
otherwise), joins the slice's processes (one per host, from ``dt.TPUClusterResolver``:
``dt.initialize_tpu_system``), and builds the replica mesh over every chip of every
host, in process order; from then on it is the strategy of
``MultiWorkerMirroredStrategy``: the same ``run``, ``reduce``, input, checkpoints and
Trainer, named inner axes included. Collectives inside a slice run over the ICI links;
with **multislice** the slices are consecutive blocks of replicas, so the replica axis
is the outer level that crosses the data-center network, and a replica stays inside one
slice (or spans whole slices).

TensorFlow's TPU spellings, mapped:

* ``experimental_device_assignment`` (a ``tf.tpu.experimental.DeviceAssignment``, or any
  object with ``num_cores_per_replica``): ``devices_per_replica=num_cores_per_replica``.
  TF counts the TPU devices the runtime lists (a chip on v4 and later, a core on v2/v3),
  as ``jax.devices()`` does. Which chips form a replica is the mesh's (process order),
  not the assignment's ``core_assignment``; its ``num_replicas`` must cover every chip.
* ``experimental_split_to_logical_devices(x, partition_dimensions)`` inside ``run``:
  ``jax.lax.with_sharding_constraint`` over the replica's inner axes (one split
  dimension: over all of them; several: one inner axis each, in order, sizes equal);
  ``experimental_replicate_to_logical_devices(x)``: replicated over them.
* ``experimental_assign_to_logical_device``: no SPMD meaning (every device runs the
  same program): an error naming layouts instead.

Example:
    >>> strategy = dt.TPUStrategy()  # on every host of a v4-16 slice  # doctest: +SKIP
    >>> strategy.num_replicas_in_sync  # one per chip  # doctest: +SKIP
    8
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from distrain._src.cluster import tpu_system
from distrain._src.cluster.base import ClusterResolver
from distrain._src.strategy.base import Strategy
from distrain._src.strategy.replica_mesh import DevicesPerReplica
from distrain._src.strategy.rules import LayoutRules, LogicalAxisRules
from distrain._src.strategy.sharded import DEFAULT_MIN_SHARD_BYTES


def devices_per_replica_from(
    device_assignment: Any, devices_per_replica: DevicesPerReplica | None
) -> DevicesPerReplica:
    """TF's ``experimental_device_assignment`` as distrain's ``devices_per_replica``.

    Raises:
        TypeError: the assignment has no integer ``num_cores_per_replica``.
        ValueError: both are given, or the count is not positive.

    Example:
        >>> class DeviceAssignment:             # TF's, built for 2 cores per replica
        ...     num_cores_per_replica, num_replicas = 2, 4
        >>> devices_per_replica_from(DeviceAssignment(), None)
        2
    """
    if device_assignment is None:
        return 1 if devices_per_replica is None else devices_per_replica
    if devices_per_replica is not None:
        raise ValueError(
            "Give the devices of a replica once: experimental_device_assignment (TF's) or "
            f"devices_per_replica (distrain's). Received both: devices_per_replica="
            f"{devices_per_replica!r} and a {type(device_assignment).__name__}."
        )
    k = getattr(device_assignment, "num_cores_per_replica", None)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(
            "experimental_device_assignment must be a tf.tpu.experimental.DeviceAssignment "
            "(an object with an integer num_cores_per_replica). Received: "
            f"{type(device_assignment).__name__} {device_assignment!r}. The distrain way: "
            "devices_per_replica=k (k chips per replica) or named inner axes such as "
            "devices_per_replica={'fsdp': 4, 'tensor': 2}."
        )
    if k < 1:
        raise ValueError(
            f"experimental_device_assignment.num_cores_per_replica must be >= 1. Received: {k}."
        )
    return k


def check_num_replicas(device_assignment: Any, num_devices: int) -> None:
    """A TF assignment's ``num_replicas`` x ``num_cores_per_replica`` must be every chip.

    Raises:
        ValueError: the assignment covers fewer (or more) devices than there are.
    """
    replicas = getattr(device_assignment, "num_replicas", None)
    if device_assignment is None or replicas is None:
        return
    k = device_assignment.num_cores_per_replica
    if replicas * k != num_devices:
        raise ValueError(
            f"experimental_device_assignment covers num_replicas x num_cores_per_replica = "
            f"{replicas} x {k} = {replicas * k} TPU devices, but the slice has {num_devices}. "
            f"dt.TPUStrategy uses every chip: expected num_replicas={num_devices // k}, or "
            f"pass devices_per_replica={k} alone."
        )


def check_slices(devices: Sequence[Any], k: int) -> int:
    """The number of slices; a replica of ``k`` devices must lie inside one or span whole ones.

    Raises:
        ValueError: slices of different sizes, or replicas that would cut across slices.
    """
    sizes = collections.Counter(getattr(d, "slice_index", 0) for d in devices)
    if len(sizes) <= 1:
        return 1
    per_slice = set(sizes.values())
    if len(per_slice) > 1:
        raise ValueError(
            "Every slice of a multislice job must have the same number of TPU devices. "
            f"Received: {dict(sorted(sizes.items()))} (slice: devices)."
        )
    n = per_slice.pop()
    if n % k and k % n:
        raise ValueError(
            f"A replica of {k} devices would cut across slices of {n} devices: its inner "
            "collectives would run over the data-center network. Expected devices_per_replica "
            f"dividing {n} (a replica inside a slice) or a multiple of it (whole slices)."
        )
    return len(sizes)


def split_spec(partition_dimensions: Sequence[int], inner: Mapping[str, int]) -> PartitionSpec:
    """TF's ``partition_dimensions`` as a spec over a replica's inner axes.

    Raises:
        ValueError: the product is not the devices per replica, or several split
            dimensions do not match the inner axes one to one.

    Example:
        >>> split_spec([1, 4], {"model": 4})
        P(None, 'model')
        >>> split_spec([2, 1, 2], {"fsdp": 2, "tensor": 2})
        P('fsdp', None, 'tensor')
    """
    k = math.prod(inner.values())
    if math.prod(partition_dimensions) != k:
        raise ValueError(
            f"partition_dimensions must multiply to the devices of a replica ({k}, "
            f"devices_per_replica={dict(inner) or 1}). Received: {list(partition_dimensions)}."
        )
    split = [i for i, n in enumerate(partition_dimensions) if n > 1]
    entries: list[Any] = [None] * len(partition_dimensions)
    axes = [(name, size) for name, size in inner.items() if size > 1]
    if len(split) == 1:
        names = tuple(name for name, _ in axes)
        entries[split[0]] = names[0] if len(names) == 1 else names
    elif [partition_dimensions[i] for i in split] == [size for _, size in axes]:
        for i, (name, _) in zip(split, axes, strict=True):
            entries[i] = name
    elif split:
        raise ValueError(
            f"partition_dimensions={list(partition_dimensions)} splits {len(split)} dimensions, "
            f"but the replica's inner axes are {dict(inner)}: expected one inner axis per split "
            "dimension, sizes in order. The distrain way: name the axes, e.g. "
            "devices_per_replica={'rows': 2, 'cols': 2}, and write "
            "jax.lax.with_sharding_constraint(x, P('rows', 'cols')) inside the step."
        )
    return PartitionSpec(*entries)


class TPUStrategy(Strategy):
    """Synchronous training over the TPU chips of one host or of a whole slice (or slices).

    ``tf.distribute.TPUStrategy``: one replica per chip by default, every host of the
    slice running the same program (one process per host); the same ``run``, ``reduce``,
    input and ``Trainer`` as ``dt.MultiWorkerMirroredStrategy``, whose layout options it
    takes too. See the module docstring for TF's device assignment and logical devices.

    Create it first thing in the program: JAX joins a cluster only before it starts.

    Args:
      cluster_resolver: the processes; default ``dt.TPUClusterResolver()`` where a TPU
        worker id can be read (a Cloud TPU VM, a GKE TPU pod), else this host alone.
      experimental_device_assignment: TF's ``DeviceAssignment``: its
        ``num_cores_per_replica`` becomes ``devices_per_replica``.
      experimental_spmd_xla_partitioning: accepted for TF code; distrain always splits a
        replica with XLA's SPMD partitioner.
      tpu_cluster_resolver: TF's keyword for ``cluster_resolver``.
      device_assignment: ``tf.distribute.experimental.TPUStrategy``'s keyword for
        ``experimental_device_assignment``.
      shard_state, min_shard_bytes, devices_per_replica, layout, logical_axis_rules,
        batch_layout: as in ``dt.MultiWorkerMirroredStrategy``.

    Raises:
      RuntimeError: no TPU devices here (before anything starts), or JAX already
        started without the cluster.
      TypeError: a resolver or device assignment of the wrong type, or one given twice.
      ValueError: the resolver's variables are wrong, or the replica's devices do not fit
        the chips, the slices or the device assignment.

    Example:
      >>> resolver = dt.TPUClusterResolver(tpu="")  # on every TPU host  # doctest: +SKIP
      >>> dt.initialize_tpu_system(resolver)  # doctest: +SKIP
      >>> strategy = dt.TPUStrategy(resolver, devices_per_replica={"fsdp": 4})  # doctest: +SKIP
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        experimental_device_assignment: Any = None,
        experimental_spmd_xla_partitioning: bool = False,
        *,
        tpu_cluster_resolver: ClusterResolver | None = None,
        device_assignment: Any = None,
        shard_state: bool | Literal["process"] = False,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
        devices_per_replica: DevicesPerReplica | None = None,
        layout: LayoutRules | None = None,
        logical_axis_rules: LogicalAxisRules | None = None,
        batch_layout: LayoutRules | None = None,
    ) -> None:
        cluster_resolver = _once("cluster_resolver", cluster_resolver, tpu_cluster_resolver)
        assignment = _once(
            "experimental_device_assignment", experimental_device_assignment, device_assignment
        )
        if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                "cluster_resolver must be a dt.ClusterResolver (e.g. dt.TPUClusterResolver()). "
                f"Received: {type(cluster_resolver).__name__}."
            )
        if not isinstance(experimental_spmd_xla_partitioning, bool):
            raise TypeError(
                "experimental_spmd_xla_partitioning must be a bool. Received: "
                f"{experimental_spmd_xla_partitioning!r}."
            )
        per_replica = devices_per_replica_from(assignment, devices_per_replica)
        # The one clear error on a machine without TPUs comes first: nothing joined yet.
        tpu_system.check_tpu_available("dt.TPUStrategy")
        self._cluster_resolver = tpu_system.initialize_tpu_system(cluster_resolver)
        devices = sorted(
            tpu_system.tpu_devices(),
            key=lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id),
        )
        check_num_replicas(assignment, len(devices))
        super().__init__(
            devices,
            devices_per_replica=per_replica,
            layout=layout,
            logical_axis_rules=logical_axis_rules,
            batch_layout=batch_layout,
            min_shard_bytes=min_shard_bytes,
            shard_state=shard_state,
        )
        self._num_slices = check_slices(devices, self.devices_per_replica)

    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        return self._placement.state_sharding(shape, path)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver this strategy joined the slice with."""
        return self._cluster_resolver

    @property
    def num_processes(self) -> int:
        return jax.process_count()

    @property
    def process_id(self) -> int:
        return jax.process_index()

    @property
    def num_slices(self) -> int:
        """Slices of a multislice job (1 otherwise): consecutive blocks of replicas."""
        return self._num_slices

    # ------------------------------------------------ TF's logical devices, in a replica
    def experimental_split_to_logical_devices(
        self, tensor: jax.Array, partition_dimensions: Sequence[int]
    ) -> jax.Array:
        """Inside ``run``: ``tensor`` split over the replica's devices, TF's way.

        ``partition_dimensions[i]`` pieces along dimension ``i``; their product is the
        devices per replica. One split dimension goes over all inner axes; several go
        one inner axis each, in order (``devices_per_replica={"rows": 2, "cols": 2}``
        and ``[2, 2]``). Equivalent to ``jax.lax.with_sharding_constraint`` with
        ``split_spec(partition_dimensions, strategy.inner_axes)``.

        Raises:
          ValueError: ``partition_dimensions`` has the wrong length or values, or does
            not map onto the inner axes.
          RuntimeError: called outside ``run``.

        Example:
          >>> def step(x):   # with devices_per_replica=2
          ...     return strategy.experimental_split_to_logical_devices(x * 2, [1, 2])
        """
        dims = list(partition_dimensions)
        shape = tuple(jnp.shape(tensor))
        if len(dims) != len(shape) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in dims
        ):
            raise ValueError(
                "partition_dimensions must have one positive int per dimension of the tensor "
                f"(shape {shape}). Received: {dims!r}."
            )
        return self._constrain(tensor, split_spec(dims, self._placement.inner_axes), "split")

    def experimental_replicate_to_logical_devices(self, tensor: jax.Array) -> jax.Array:
        """Inside ``run``: ``tensor`` whole on every device of the replica.

        Raises:
          RuntimeError: called outside ``run``.
        """
        return self._constrain(tensor, PartitionSpec(), "replicate")

    def experimental_assign_to_logical_device(
        self, tensor: jax.Array, logical_device_id: int
    ) -> jax.Array:
        """TF's placement of a tensor on one core of a replica: not available.

        Raises:
          NotImplementedError: always; what to use instead.
        """
        raise NotImplementedError(
            "experimental_assign_to_logical_device places a tensor on one core (TF's MPMD "
            f"model parallelism; logical_device_id={logical_device_id!r}). A JAX replica runs "
            "one SPMD program on all its devices, so a tensor is split or replicated, not "
            "assigned: use experimental_split_to_logical_devices, "
            "jax.lax.with_sharding_constraint over the inner axes, or layout rules "
            "(devices_per_replica={...}, layout={...}; docs/scaling.md)."
        )

    def _constrain(self, tensor: jax.Array, spec: PartitionSpec, what: str) -> jax.Array:
        if not self._placement.inner_axes:
            return tensor  # one device per replica: split and whole are the same
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or not set(self._placement.inner_axes) <= set(mesh.axis_names):
            raise RuntimeError(
                f"experimental_{what}_to_logical_devices lays a value out over the devices of "
                "a replica, so it runs inside the replica function: call it in the function "
                "given to strategy.run (as in TensorFlow). Received: a call outside it."
            )
        return jax.lax.with_sharding_constraint(tensor, spec)

    def __repr__(self) -> str:
        return (
            f"TPUStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"devices_per_replica={self.devices_per_replica}, num_slices={self._num_slices}, "
            f"num_processes={jax.process_count()}, process_id={jax.process_index()})"
        )


def _once(name: str, value: Any, tf_value: Any) -> Any:
    if tf_value is None:
        return value
    if value is not None:
        tf_name = "tpu_cluster_resolver" if name == "cluster_resolver" else "device_assignment"
        raise TypeError(
            f"Give {name} once: TensorFlow's keyword {tf_name} and {name} name the same "
            "argument. Received both."
        )
    return tf_value
