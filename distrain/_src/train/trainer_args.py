"""What ``dt.Trainer`` accepts as its ``strategy`` and ``islands``, checked when it is
built, so that a wrong one fails in one line before any training.

Example::

    self.strategy = check_strategy(strategy)  # in Trainer.__init__
"""

from __future__ import annotations

from typing import Any

from distrain._src.strategy.base import Strategy

__all__ = ["check_islands", "check_strategy"]


def check_strategy(strategy: Any) -> Strategy:
    """A synchronous distrain strategy, as given.

    Raises:
      TypeError: anything else; a ``ParameterServerStrategy`` says how it trains instead.
    """
    if isinstance(strategy, Strategy):
        return strategy
    from distrain._src.ps.ps_strategy import ParameterServerStrategy

    if isinstance(strategy, ParameterServerStrategy):
        raise TypeError(
            "The Trainer runs synchronous strategies; ParameterServerStrategy trains "
            "asynchronously through a coordinator: "
            "`coordinator = dt.experimental.coordinator.ClusterCoordinator(strategy)`, then "
            "`coordinator.schedule(step, args=(...))` and `coordinator.join()` "
            "(docs/parameter_server.md). For the Trainer use dt.MirroredStrategy() or "
            "dt.MultiWorkerMirroredStrategy()."
        )
    raise TypeError(
        "`strategy` must be a distrain strategy (a dt.Strategy such as dt.MirroredStrategy()). "
        f"Received: {strategy!r}."
    )


def check_islands(islands: Any) -> Any:
    """None, or a ``dt.experimental.islands.FaultIsolation`` (``Trainer(islands=...)``).

    Raises:
      TypeError: anything else.
    """
    if islands is None:
        return None
    from distrain._src.islands.island import FaultIsolation

    if isinstance(islands, FaultIsolation):
        return islands
    raise TypeError(
        "`islands` must be dt.experimental.islands.FaultIsolation(sync_every=..., "
        f"directory=...) or None. Received: {islands!r}."
    )
