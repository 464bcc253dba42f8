"""The compiled side of ``Trainer.fit``: fused dispatches and the on-device metric window.

``fit``'s loop decides *when* to run steps and what callbacks hear; this module decides
*how* a group of batches becomes device work and how metrics come back:

* ``Steps.run`` dispatches ``steps_per_execution`` batches as one compiled program
  (``strategy.run`` bounds the dispatches in flight), donating the state;
* ``steps_per_execution="auto"`` times the first single steps and then fuses enough
  of them that one dispatch lasts ~4 ms (``auto_steps_per_execution``);
* the metric window: step metrics are summed per replica on the devices and read
  (a host sync) only by ``flush``, every ``log_every`` steps and at epoch ends, then
  folded into the epoch's exact (total, count) sums.

Example (what ``fit`` does per dispatch):
  >>> steps = Steps(strategy, train_step, k=4, auto=False, donate=True, warn_not_finite=True)
  >>> state = steps.run(state, batches)        # 4 batches -> one dispatch
  >>> logs = steps.flush(step=4)                # host sync: {"loss": ...}
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from distrain._src.train import _functions as F
from distrain._src.train.metrics import Metric
from distrain._src.train.progress import sums_from_json, sums_to_json
from distrain._src.values import PerReplica

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy

# steps_per_execution="auto": one dispatch should keep the devices busy this long, so
# that per-dispatch host time (tens of microseconds) is under 1% of it.
_TARGET_DISPATCH_SECONDS = 0.004
_CALIBRATION_STEPS = 4
_MAX_AUTO_STEPS = 64


def auto_steps_per_execution(seconds_per_step: float, cap: int) -> int:
    """The power of two of steps that makes one dispatch last ``_TARGET_DISPATCH_SECONDS``.

    Powers of two keep the number of compiled programs small; the result is at most
    ``cap`` (and ``_MAX_AUTO_STEPS``) and at least 1.

    Example:
      >>> auto_steps_per_execution(0.0001, cap=100)   # 0.1 ms steps: 40 wanted
      64
    """
    want = max(1, math.ceil(_TARGET_DISPATCH_SECONDS / max(seconds_per_step, 1e-9)))
    k = 1 << (want - 1).bit_length()
    while k > min(cap, _MAX_AUTO_STEPS):
        k //= 2
    return max(1, k)


class Steps:
    """Runs one ``fit``'s training steps on the devices and keeps their metric sums.

    Args:
      strategy: where the steps run.
      step_fn: the per-replica ``train_step`` (as the input route wraps it).
      k: steps per dispatch (the starting value, 1, under ``auto``).
      auto: calibrate ``k`` from the first steps' times.
      donate: donate the state to each dispatch.
      warn_not_finite: warn once when a metric turns NaN/inf (off when a
        ``TerminateOnNaN`` callback will say so itself).
    """

    def __init__(
        self,
        strategy: Strategy,
        step_fn: Callable[..., Any],
        *,
        k: int,
        auto: bool,
        donate: bool,
        warn_not_finite: bool,
    ) -> None:
        self.strategy = strategy
        self.step_fn = strategy.training_step(step_fn)
        self.k = 1 if auto else k
        self._clock: float | None = 0.0 if auto else None  # None: calibrated or fixed
        self._donate = (0,) if donate else ()
        self._warn_not_finite = warn_not_finite
        self._acc: Any = None
        self._zero_acc: Any = None
        self._layout: F.Layout | None = None
        self._window_steps = 0
        self.epoch_sums: dict[str, Metric] | None = None
        self._first = True

    def set_k(self, k: int) -> None:
        """Fixes the steps per dispatch from the next dispatch on (no calibration)."""
        self.k, self._clock = k, None

    # ------------------------------------------------------------- dispatch
    def run(self, state: Any, batches: list[Any]) -> Any:
        """``state`` after one step per batch: one dispatch when ``len(batches) == k``,
        else one per batch (the end of an epoch: no program compiled for a rare size)."""
        if self._acc is None:
            metrics_fn = F.make_metrics_fn(self.step_fn)
            shapes = F.trace_shapes(self.strategy, metrics_fn, (state, batches[0]))
            self._layout = F.Layout(shapes)
            self._zero_acc = self._acc = F.per_replica_zeros(self.strategy, self._layout.size)
        groups = [batches] if len(batches) == self.k else [[b] for b in batches]
        for group in groups:
            fn = F.make_train_fn(self.step_fn, len(group))
            state, self._acc = self.strategy.run(
                fn, args=(state, self._acc, *group), donate_argnums=self._donate
            )
        if self._first:
            _warn_if_state_varies(state)
            self._first = False
        self._window_steps += len(batches)
        return state

    def calibrate(self, state: Any, steps_done: int, caps: Iterable[int | None]) -> None:
        """Under ``auto``: after the compiling step, time ``_CALIBRATION_STEPS`` single
        steps (two host syncs, once per fit), then set ``k`` within ``caps`` (``log_every``
        and the callbacks' step intervals)."""
        if self._clock is None:
            return
        if steps_done == 1:
            jax.block_until_ready(state)
            self._clock = time.perf_counter()
        elif steps_done == 1 + _CALIBRATION_STEPS:
            jax.block_until_ready(state)
            per_step = (time.perf_counter() - self._clock) / _CALIBRATION_STEPS
            self.k = auto_steps_per_execution(per_step, min(c for c in caps if c is not None))
            self._clock = None

    # -------------------------------------------------------- metric window
    def begin_epoch(self, resumed: dict[str, Any] | None) -> None:
        """Starts an epoch's sums: empty, or those saved in a checkpoint mid-epoch."""
        self.epoch_sums = sums_from_json(resumed) if resumed else None

    def flush(self, step: int) -> dict[str, float] | None:
        """Reads the window's sums from the devices (host sync) and folds them into the
        epoch's; returns the window's metrics (None when no step ran since the last)."""
        if self._acc is None or self._layout is None or self._window_steps == 0:
            return None
        host = self._layout.unpack(jax.device_get(self.strategy.reduce("sum", self._acc)))
        self._acc = self._zero_acc
        self._window_steps = 0
        if self.epoch_sums is None:
            self.epoch_sums = host
        else:
            self.epoch_sums = {k: self.epoch_sums[k].merge(host[k]) for k in host}
        logs = {k: m.compute() for k, m in host.items()}
        self._check_finite(logs, step)
        return logs

    def epoch_logs(self, step: int) -> dict[str, float]:
        self.flush(step)
        return {k: m.compute() for k, m in (self.epoch_sums or {}).items()}

    def epoch_sums_json(self) -> dict[str, Any] | None:
        if self.epoch_sums is None:
            return None
        return {k: sums_to_json(m) for k, m in self.epoch_sums.items()}

    def _check_finite(self, logs: dict[str, Any], step: int) -> None:
        """Warns once per fit when a metric turns NaN/inf and nothing else will say so."""
        if not self._warn_not_finite:
            return
        bad = {k: v for k, v in logs.items() if np.ndim(v) == 0 and not np.isfinite(v)}
        if bad:
            self._warn_not_finite = False
            warnings.warn(
                f"Training metrics are not finite at step {step}: {bad}. The state is "
                "probably NaN from here on; add dt.callbacks.TerminateOnNaN() to stop fit at "
                "the first non-finite metric (checkpoints then keep the last good step).",
                RuntimeWarning,
                stacklevel=4,
            )


def _warn_if_state_varies(state: Any) -> None:
    varying = [
        jax.tree_util.keystr(p)
        for p, x in jax.tree_util.tree_leaves_with_path(
            state, is_leaf=lambda x: isinstance(x, PerReplica)
        )
        if isinstance(x, PerReplica)
    ]
    if varying:
        warnings.warn(
            f"train_step returned a state whose leaves {varying[:5]} differ across replicas "
            "(they came back as dt.PerReplica). Replicas then train different models. "
            "All-reduce what must agree (state.apply_gradients does it for gradients; use "
            "dt.get_replica_context().all_reduce for statistics).",
            stacklevel=5,
        )
