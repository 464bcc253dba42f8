"""The ``strategy`` section of a run config: which strategy runs the replicas, how the
state and the batch are laid out over a replica's devices, and DiLoCo's islands.

``train/strategy_from_config.py`` builds the strategy this section names.

Example:
  >>> cfg = StrategyConfig(name="mirrored", devices_per_replica=2, shard_state=True)
  >>> cfg.layout_kwargs()["devices_per_replica"]
  2
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from distrain._src.train.config_errors import ConfigError
from distrain._src.train.config_section import ConfigSection

__all__ = ["IslandsConfig", "OuterOptimizerConfig", "StrategyConfig"]


class OuterOptimizerConfig(ConfigSection):
    """DiLoCo's outer optimizer: ``getattr(optax, name)(learning_rate, **kwargs)``;
    DiLoCo's is the default, Nesterov SGD with learning rate 0.7 and momentum 0.9."""

    name: str = "sgd"
    learning_rate: float = Field(default=0.7, gt=0, allow_inf_nan=False)
    kwargs: dict[str, Any] = {"momentum": 0.9, "nesterov": True}


class IslandsConfig(ConfigSection):
    """``strategy.islands`` for ``strategy.name: diloco`` (``docs/islands.md``).

    Attributes:
      islands: the number of islands (equal groups of the devices).
      sync_every: ``H``, inner steps per round.
      outer_optimizer: the outer optimizer (default DiLoCo's).
      fragments, fragment_sync_delay, fragment_update_alpha, outer_dtype: Streaming
        DiLoCo's, as ``dt.experimental.DiLoCoStrategy`` takes them.
    """

    islands: pydantic.PositiveInt = Field(
        description="the number of islands, which must divide the devices, e.g. 4"
    )
    sync_every: pydantic.PositiveInt = Field(
        description="H, the inner steps between outer steps, e.g. 50"
    )
    outer_optimizer: OuterOptimizerConfig = OuterOptimizerConfig()
    fragments: pydantic.PositiveInt | list[str] = 1
    fragment_sync_delay: pydantic.NonNegativeInt = 0
    fragment_update_alpha: float = Field(default=0.0, ge=0.0, le=1.0)
    outer_dtype: Literal["float32", "bfloat16", "int8", "int4"] = "float32"


class StrategyConfig(ConfigSection):
    """Which strategy runs the replicas.

    Attributes:
      name: ``mirrored`` (all local devices), ``one_device``, ``default`` (no
        distribution), ``multi_worker_mirrored``, ``central_storage``, ``tpu`` (every
        chip of the TPU slice, on every host: ``dt.TPUStrategy``) or ``diloco``
        (islands: ``islands`` below).
      devices: for ``mirrored``/``central_storage``: device names like ``"cpu:0"``;
        default all local devices. For ``one_device``: the first entry (default the
        first device).
      shard_state: for ``mirrored``/``multi_worker_mirrored``/``tpu``: store parameters and
        optimizer state split over the devices (``true``), or over each process's
        devices with a copy per process (``process``; docs/scaling.md).
      devices_per_replica: for ``mirrored``/``multi_worker_mirrored``/``tpu``: devices each
        replica spans (FSDP inside a replica; ``process``: one replica per process), or
        its named inner axes, e.g. ``{fsdp: 4, tensor: 2}`` (docs/scaling.md).
      layout: with ``devices_per_replica``: ``{path pattern: spec}`` rules, a spec being
        a list with one entry per dimension: an inner axis, a list of axes, a logical
        name or ``null``, e.g. ``{"mlp/fc/kernel": [fsdp, tensor]}``; or the import path
        of rules kept in code (``distrain.models:TENSOR_PARALLEL_LAYOUT``).
      logical_axis_rules: ``{logical name: inner axis, list of axes or null}``.
      batch_layout: ``{batch leaf pattern: spec}`` (a spec as in ``layout``, its first
        entry ``null`` for the rows), e.g. ``{tokens: [null, context]}``.
      islands: with ``name: diloco`` (required there, refused elsewhere): the islands
        and their outer step (:class:`IslandsConfig`); the layout fields apply inside
        each island.
    """

    name: Literal[
        "mirrored",
        "one_device",
        "default",
        "multi_worker_mirrored",
        "central_storage",
        "tpu",
        "diloco",
    ] = "mirrored"
    devices: list[str] | None = None
    shard_state: bool | Literal["process"] = False
    devices_per_replica: (
        pydantic.PositiveInt | Literal["process"] | dict[str, pydantic.PositiveInt]
    ) = 1
    layout: dict[str, list[str | list[str] | None]] | str | None = None
    logical_axis_rules: dict[str, str | list[str] | None] | None = None
    batch_layout: dict[str, list[str | list[str] | None]] | None = None
    islands: IslandsConfig | None = None

    @pydantic.model_validator(mode="after")
    def _layouts_need_data_parallel(self) -> StrategyConfig:
        if (self.name == "diloco") != (self.islands is not None):
            raise ConfigError(
                "strategy.name=diloco needs strategy.islands (at least islands and "
                "sync_every), and strategy.islands applies to strategy.name=diloco only. "
                f"Received: strategy.name={self.name!r} and strategy.islands="
                f"{'set' if self.islands is not None else 'null'}."
            )
        if self.name == "tpu" and self.devices is not None:
            raise ConfigError(
                "strategy.devices does not apply to strategy.name=tpu (it takes every chip "
                f"of the slice). Received: strategy.devices={self.devices!r}; remove it, or "
                "use strategy.name=mirrored to choose this process's devices."
            )
        if self.name == "diloco" and self.shard_state:
            raise ConfigError(
                "strategy.shard_state does not apply to strategy.name=diloco (each island "
                "keeps its own copy). Received: strategy.shard_state="
                f"{self.shard_state!r}; remove it, or lay the state out inside each island "
                "with devices_per_replica."
            )
        for field, off in (
            ("shard_state", False),
            ("devices_per_replica", 1),
            ("layout", None),
            ("logical_axis_rules", None),
            ("batch_layout", None),
        ):
            if getattr(self, field) != off and self.name not in (
                "mirrored",
                "multi_worker_mirrored",
                "tpu",
                "diloco",
            ):
                raise ConfigError(
                    f"strategy.{field} applies to strategy.name mirrored, "
                    f"multi_worker_mirrored, tpu or diloco. Received: strategy.name="
                    f"{self.name!r}; set strategy.{field}="
                    f"{'null' if off is None else str(off).lower()} or change the strategy."
                )
        return self

    def layout_kwargs(self) -> dict[str, Any]:
        """``devices_per_replica``, ``layout`` and ``batch_layout`` (specs as
        PartitionSpecs) and ``logical_axis_rules``, as the strategy takes them."""
        from jax.sharding import PartitionSpec as P

        def entry(e: str | list[str] | None) -> str | tuple[str, ...] | None:
            return tuple(e) if isinstance(e, list) else e

        def specs(rules: dict[str, list[Any]] | None) -> dict[str, P] | None:
            return None if rules is None else {k: P(*map(entry, v)) for k, v in rules.items()}

        logical = (
            None
            if self.logical_axis_rules is None
            else {k: entry(v) for k, v in self.logical_axis_rules.items()}
        )
        return {
            "devices_per_replica": self.devices_per_replica,
            "layout": self.layout if isinstance(self.layout, str) else specs(self.layout),
            "logical_axis_rules": logical,
            "batch_layout": specs(self.batch_layout),
        }
