"""``CentralStorageStrategy``: state on one device, compute replicated over others."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from distrain._src.strategy.base import Strategy
from distrain._src.strategy.devices import DeviceSpec, parse_device, parse_devices


class CentralStorageStrategy(Strategy):
    """Parameters and optimizer state live on one device; every step is replicated.

    Each ``run`` copies the state from the parameter device to the compute devices and
    the new (replicated) state back. That costs two copies of the state per step, and
    pays off when the compute devices are short of memory or there is a single GPU.

    Args:
      compute_devices: devices that run replicas (default: all local devices).
      parameter_device: where state lives (default: the host CPU).

    Example:
      >>> strategy = dt.experimental.CentralStorageStrategy()
      >>> state = strategy.put_replicated(state)   # now on the parameter device
    """

    def __init__(
        self,
        compute_devices: Sequence[DeviceSpec] | None = None,
        parameter_device: DeviceSpec | None = None,
    ) -> None:
        if parameter_device is None:
            self.parameter_device = jax.local_devices(backend="cpu")[0]
        else:
            self.parameter_device = parse_device(parameter_device, jax.devices() + _cpus())
        super().__init__(parse_devices(compute_devices), state_device=self.parameter_device)

    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        return self._placement.state_sharding(shape, path)


def _cpus() -> list[jax.Device]:
    return list(jax.local_devices(backend="cpu"))
