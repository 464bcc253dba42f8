"""``dt.experimental.islands``: fault-isolated islands (DiLoCo across separate JAX worlds).

Each island is its own process group (``--nproc-per-island`` processes); a Ray actor, the
:class:`IslandCoordinator`, holds the rounds, the membership and the row ledger, and one
shard holder per island holds its share of the global parameters and of the outer
optimizer. Start them with ``distrain launch --islands N -- python train.py``, where
``train.py`` calls
:func:`train`, or ``dt.Trainer(..., islands=FaultIsolation(...)).fit(...)``
(``docs/islands.md``, "Fault-isolated islands", "Through the Trainer").
"""

from distrain._src.islands.delayed_nesterov import delayed_nesterov as delayed_nesterov
from distrain._src.islands.island import FaultIsolation as FaultIsolation
from distrain._src.islands.island import IslandsResult as IslandsResult
from distrain._src.islands.island import random_access as random_access
from distrain._src.islands.island import train as train
from distrain._src.islands.island_coordinator import IslandCoordinator as IslandCoordinator
from distrain._src.islands.island_coordinator import IslandsConfig as IslandsConfig
from distrain._src.islands.island_coordinator import IslandsFailed as IslandsFailed
from distrain._src.islands.island_coordinator import RejoinRequired as RejoinRequired
from distrain._src.islands.island_coordinator import committed_rows as committed_rows
from distrain._src.islands.rows import RowLedger as RowLedger

__all__ = [
    "FaultIsolation",
    "IslandCoordinator",
    "IslandsConfig",
    "IslandsFailed",
    "IslandsResult",
    "RejoinRequired",
    "RowLedger",
    "committed_rows",
    "delayed_nesterov",
    "random_access",
    "train",
]
