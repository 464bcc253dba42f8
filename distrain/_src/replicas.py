"""What the data path needs of a strategy: its replicas and how a batch is laid out.

``data/`` (distributed datasets, placement, input contexts) types against this
protocol instead of the ``Strategy`` class, so the dependency runs one way:
``strategy/`` imports ``data/`` (``experimental_distribute_dataset`` and friends) and
``data/`` never imports ``strategy/``. Every ``dt.Strategy`` satisfies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax


class Replicas(Protocol):
    """The placement side of a strategy (see the module docstring)."""

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices, in replica order."""
        ...

    @property
    def devices_per_replica(self) -> int:
        """How many devices each replica spans."""
        ...

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas there are."""
        ...

    @property
    def replica_layout(self) -> BatchPlacement:
        """Where batches live (a ``dt.ReplicaLayout``)."""
        ...


class BatchPlacement(Protocol):
    """What the data path reads of a strategy's ``ReplicaLayout``."""

    def batch_shardings(
        self, leaves: Sequence[Any], treedef: Any, rows: int, layout: bool = True
    ) -> list[Any]:
        """One sharding per leaf of a global batch of ``rows`` rows."""
        ...
