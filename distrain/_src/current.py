"""``dt.get_strategy()``: the current strategy, typed for users.

Its own module, above both the strategies and the parameter-server package: the
replica context (``context.py``), which they all import, then imports neither, not even
for types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain._src import context

if TYPE_CHECKING:
    from distrain._src.ps.ps_strategy import ParameterServerStrategy
    from distrain._src.strategy.base import Strategy


def get_strategy() -> Strategy | ParameterServerStrategy:
    """The strategy of the innermost ``scope()``, else the default (one replica) strategy.

    Inside a ``dt.experimental.ParameterServerStrategy``'s scope that strategy, which is
    not a ``dt.Strategy`` (it has no ``run``: its workers run through a coordinator).
    """
    strategy: Strategy | ParameterServerStrategy = context.current_strategy()
    return strategy
