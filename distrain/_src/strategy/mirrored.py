"""``MirroredStrategy``: one replica per device, state mirrored, gradients all-reduced."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax

from distrain._src.cross_device_ops import CrossDeviceOps
from distrain._src.strategy.base import Strategy
from distrain._src.strategy.devices import DeviceSpec, parse_devices
from distrain._src.strategy.replica_mesh import DevicesPerReplica
from distrain._src.strategy.rules import LayoutRules, LogicalAxisRules
from distrain._src.strategy.sharded import DEFAULT_MIN_SHARD_BYTES


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of this process; a replica may span
    several devices (FSDP and tensor parallelism inside it).

    Args:
      devices: devices to use, as ``jax.Device``s, ids or strings like ``"cpu:1"``;
        default: all local devices.
      cross_device_ops: how gradients are summed: ``dt.AllReduce()`` (default),
        ``dt.HierarchicalCopyAllReduce(num_packs)`` or ``dt.ReductionToOneDevice()``.
      shard_state: keep ``1/N`` of each large state leaf per device between steps
        (FSDP / ZeRO-3 storage; ``docs/scaling.md``). Results are the same.
        ``"process"`` is the same here (one process); it matters for
        ``MultiWorkerMirroredStrategy``.
      min_shard_bytes: with ``shard_state`` or ``devices_per_replica``, leaves below
        this size stay replicated.
      devices_per_replica: the devices of one replica: ``k`` neighbours (one inner axis
        ``"model"``), or a named mesh such as ``{"fsdp": 4, "tensor": 2}``
        (``num_replicas_in_sync == len(devices) // k``): inside every step XLA keeps
        each large state leaf split over the replica's devices (FSDP) and splits the
        replica's batch over them; the per-replica ``train_step`` is unchanged
        (``docs/scaling.md``).
      layout: with ``devices_per_replica``, rules ``{path pattern: PartitionSpec}`` over
        the inner axes (e.g. ``{"mlp/up/kernel": P("fsdp", "tensor")}``) or a pytree of
        specs (flax's ``nnx.get_partition_spec``); other leaves are split FSDP-style.
      logical_axis_rules: ``{logical name: inner axis or None}`` for specs in logical
        names (``{"embed": "fsdp", "mlp": "tensor"}``).
      batch_layout: ``{batch leaf pattern: PartitionSpec}`` splitting other dimensions
        of batch leaves over inner axes, e.g. ``{"tokens": P(None, "context")}``.

    Example:
      >>> strategy = dt.MirroredStrategy()            # all local devices
      >>> strategy = dt.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> strategy = dt.MirroredStrategy(devices_per_replica=4)   # 2 replicas x 4 devices
      >>> strategy = dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2})
    """

    def __init__(
        self,
        devices: Sequence[DeviceSpec] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        *,
        shard_state: bool | Literal["process"] = False,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
        devices_per_replica: DevicesPerReplica = 1,
        layout: LayoutRules | None = None,
        logical_axis_rules: LogicalAxisRules | None = None,
        batch_layout: LayoutRules | None = None,
    ) -> None:
        super().__init__(
            parse_devices(devices),
            cross_device_ops,
            devices_per_replica=devices_per_replica,
            layout=layout,
            logical_axis_rules=logical_axis_rules,
            batch_layout=batch_layout,
            min_shard_bytes=min_shard_bytes,
            shard_state=shard_state,
        )

    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        return self._placement.state_sharding(shape, path)
