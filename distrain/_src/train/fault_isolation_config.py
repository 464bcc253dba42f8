"""The ``fault_isolation`` section of a run config: fault-isolated islands, each a
``distrain launch --islands N --nproc-per-island P`` process group that runs the rest of
the config with ``strategy`` inside the island (``docs/islands.md``, "Through the
Trainer"). ``run_config`` builds :class:`~distrain._src.islands.island.FaultIsolation`
from it with :meth:`FaultIsolationConfig.build`, and gives each island its own logging
and checkpoint directories (``.../island-I``).

Example (YAML)::

    fault_isolation:
      sync_every: 20
      directory: runs/islands
      death_timeout: 10
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from distrain._src.train.config_section import ConfigSection
from distrain._src.train.strategy_config import OuterOptimizerConfig

__all__ = ["FaultIsolationConfig"]


class FaultIsolationConfig(ConfigSection):
    """Fault-isolated islands (``dt.experimental.islands.FaultIsolation``; the fields
    are its arguments, ``docs/islands.md``).

    Attributes:
      sync_every: H, inner steps per round.
      directory: the run's directory: the coordinator's checkpoints, each island's
        goodput ledger and timeline.
      outer_optimizer: the outer optimizer (default DiLoCo's Nesterov SGD; with
        ``mode: async``, ``null`` gives delayed Nesterov).
      heal_from_peer: a (re)joining island takes a live island's inner optimizer state.
      outer_dtype: what the pseudo-gradients travel as (Streaming DiLoCo's codecs).
    """

    sync_every: pydantic.PositiveInt = Field(description="H, inner steps per round, e.g. 20")
    directory: str = Field(description="the run's directory, e.g. runs/islands")
    outer_optimizer: OuterOptimizerConfig | None = OuterOptimizerConfig()
    min_islands: pydantic.PositiveInt = 1
    death_timeout: float = Field(default=10.0, gt=0)
    heartbeat_interval: float = Field(default=1.0, gt=0)
    start_timeout: float = Field(default=120.0, gt=0)
    min_islands_timeout: float = Field(default=300.0, gt=0)
    mode: Literal["sync", "async"] = "sync"
    max_staleness: pydantic.NonNegativeInt | None = None
    round_timeout: float | None = Field(default=None, gt=0)
    call_timeout: float = Field(default=120.0, gt=0)
    heal_from_peer: bool = True
    outer_dtype: Literal["float32", "bfloat16", "int8", "int4"] = "float32"

    def build(self, seed: int | None) -> Any:
        """The ``FaultIsolation`` this section describes (``seed``: the row order's)."""
        from distrain._src.islands.island import FaultIsolation
        from distrain._src.train.optimizer import optimizer_by_name

        fields = self.model_dump(exclude={"outer_optimizer"})
        o, section = self.outer_optimizer, "fault_isolation.outer_optimizer"
        tx = (
            None
            if o is None
            else optimizer_by_name(o.name, o.learning_rate, o.kwargs, section=section)
        )
        return FaultIsolation(**fields, seed=seed, outer_optimizer=tx)
