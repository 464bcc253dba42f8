"""``MirroredStrategy``: one replica per device, state mirrored, gradients all-reduced."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from distrain.cross_device_ops import CrossDeviceOps
from distrain.strategy.base import Strategy
from distrain.strategy.devices import DeviceSpec, parse_devices


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of this process.

    Args:
      devices: devices to use, as ``jax.Device``s, ids or strings like ``"cpu:1"``;
        default: all local devices.
      cross_device_ops: how gradients are summed: ``dt.AllReduce()`` (default),
        ``dt.HierarchicalCopyAllReduce(num_packs)`` or ``dt.ReductionToOneDevice()``.

    Example:
      >>> strategy = dt.MirroredStrategy()            # all local devices
      >>> strategy = dt.MirroredStrategy(["cpu:0", "cpu:1"])
    """

    def __init__(
        self,
        devices: Sequence[DeviceSpec] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
    ) -> None:
        super().__init__(parse_devices(devices), cross_device_ops)

    @property
    def state_sharding(self) -> jax.sharding.Sharding:
        return self._replicated  # a full copy on every replica
