"""``OneDeviceStrategy`` and the default strategy: a single replica."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext

import jax

from distrain._src import context
from distrain._src.strategy.base import Strategy
from distrain._src.strategy.devices import DeviceSpec, parse_device


class OneDeviceStrategy(Strategy):
    """Runs everything on one device, through the same code path as the other strategies.

    Example:
      >>> strategy = dt.OneDeviceStrategy("cpu:0")
    """

    def __init__(self, device: DeviceSpec) -> None:
        super().__init__([parse_device(device)])

    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        return self._placement.state_sharding(shape, path)


class _DefaultStrategy(Strategy):
    """The strategy in force outside any ``scope()``: one replica on the first device."""

    def __init__(self) -> None:
        super().__init__([jax.devices()[0]])

    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        return self._placement.state_sharding(shape, path)

    def scope(self) -> AbstractContextManager[Strategy]:
        # Entering the default scope changes nothing: it is already current.
        return nullcontext(self)


@functools.cache
def default_strategy() -> Strategy:
    return _DefaultStrategy()


context.register_default_strategy(default_strategy)
