"""The strategy a run config's ``strategy`` section names, built.

``distrain train`` builds it first: a multi-worker strategy joins its cluster here, and
``strategy.name=tpu`` checks that a TPU is there before anything starts. Errors name the
config field, not the strategy's Python argument.

Example:
  >>> from distrain._src.train.strategy_config import StrategyConfig
  >>> build_strategy(StrategyConfig(name="mirrored")).num_replicas_in_sync
  8
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

from distrain._src.train.config_errors import ConfigError
from distrain._src.train.import_paths import resolve_import
from distrain._src.train.strategy_config import StrategyConfig

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy

__all__ = ["build_strategy"]


def build_strategy(cfg: StrategyConfig) -> Strategy:
    """The strategy a config names (created first: multi-worker joins the cluster here)."""
    from distrain._src.current import get_strategy
    from distrain._src.islands.diloco_strategy import DiLoCoStrategy
    from distrain._src.strategy.base import Strategy
    from distrain._src.strategy.central_storage import CentralStorageStrategy
    from distrain._src.strategy.mirrored import MirroredStrategy
    from distrain._src.strategy.multi_worker import MultiWorkerMirroredStrategy
    from distrain._src.strategy.one_device import OneDeviceStrategy
    from distrain._src.strategy.tpu_strategy import TPUStrategy

    layout = cfg.layout_kwargs()
    if isinstance(cfg.layout, str):  # rules kept in code, e.g. the LM example's
        layout["layout"] = resolve_import(cfg.layout, "strategy.layout")
    if cfg.name == "mirrored":
        return MirroredStrategy(cfg.devices, shard_state=cfg.shard_state, **layout)
    if cfg.name == "one_device":
        return OneDeviceStrategy(cfg.devices[0] if cfg.devices else jax.devices()[0])
    if cfg.name == "default":
        current = get_strategy()
        if not isinstance(current, Strategy):
            raise ConfigError(
                "strategy.name=default trains on the current strategy, and the current one is "
                f"{current!r}, which the Trainer does not run (it trains through a "
                "coordinator). Call run_config outside its scope, or name a strategy: "
                "mirrored, one_device, multi_worker_mirrored, central_storage or tpu."
            )
        return current
    if cfg.name == "multi_worker_mirrored":
        return MultiWorkerMirroredStrategy(shard_state=cfg.shard_state, **layout)
    if cfg.name == "tpu":
        from distrain._src.cluster import tpu_system

        try:  # before the strategy joins a cluster or starts a backend
            tpu_system.check_tpu_available("strategy.name=tpu (dt.TPUStrategy)")
        except RuntimeError as e:
            raise ConfigError(
                f"{e} In a config: strategy.name=mirrored (this machine's devices) or "
                "multi_worker_mirrored (several machines)."
            ) from e
        return TPUStrategy(shard_state=cfg.shard_state, **layout)
    if cfg.name == "diloco" and cfg.islands is not None:
        isl = cfg.islands
        outer = isl.outer_optimizer
        try:
            return DiLoCoStrategy(
                isl.islands,
                isl.sync_every,
                _optimizer(
                    outer.name,
                    outer.learning_rate,
                    outer.kwargs,
                    "strategy.islands.outer_optimizer",
                ),
                fragments=isl.fragments,
                fragment_sync_delay=isl.fragment_sync_delay,
                fragment_update_alpha=isl.fragment_update_alpha,
                outer_dtype=isl.outer_dtype,
                devices=cfg.devices,
                **layout,
            )
        except ValueError as e:  # the strategy's own words name its Python argument
            if not str(e).startswith(f"islands={isl.islands} must divide"):
                raise
            n = len(cfg.devices) if cfg.devices else jax.device_count()
            raise ConfigError(
                f"Config field 'strategy.islands.islands' ({isl.islands}) must divide the "
                f"{n} devices (equal islands). Use one of "
                f"{[d for d in range(1, n + 1) if n % d == 0]}, choose the devices with "
                "strategy.devices=[...], or on a CPU start more (virtual) devices, as "
                "docs/islands.md does: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                "distrain train ..."
            ) from e
    return CentralStorageStrategy(compute_devices=cfg.devices)


def _optimizer(
    name: str, learning_rate: float, kwargs: Mapping[str, Any], section: str = "optimizer"
) -> Any:
    """``getattr(optax, name)(learning_rate, **kwargs)`` (``optimizer.optimizer_by_name``)."""
    from distrain._src.train.optimizer import optimizer_by_name

    return optimizer_by_name(name, learning_rate, kwargs, section=section)
