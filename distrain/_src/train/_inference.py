"""The evaluation and prediction loops behind ``Trainer.evaluate`` and ``Trainer.predict``.

Both iterate a distributed dataset (from ``_input.distribute``) once (or ``steps``
batches) with bounded steps in flight (``strategy.run``) and read the devices once, at
the end: evaluation keeps per-replica metric sums on the devices; prediction gathers
each batch's outputs and drops padded rows on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from distrain._src.train import _functions as F

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy


class ZeroCache:
    """Per-replica zero accumulators (and their layouts), one per step and input shapes."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._cache: dict[Any, tuple[F.Layout, Any]] = {}

    def get(self, metrics_fn: Callable[..., Any], state: Any, batch: Any) -> tuple[F.Layout, Any]:
        leaves = jax.tree.leaves((state, batch))
        key = (
            metrics_fn,
            jax.tree.structure((state, batch)),
            tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves),
        )
        cached = self._cache.get(key)
        if cached is None:
            layout = F.Layout(F.trace_shapes(self._strategy, metrics_fn, (state, batch)))
            cached = self._cache[key] = (layout, F.per_replica_zeros(self._strategy, layout.size))
        return cached


def evaluate_loop(
    strategy: Strategy,
    eval_fn: Any,
    zeros: ZeroCache,
    state: Any,
    batches: Iterable[Any],
    steps: int | None,
) -> dict[str, float]:
    """``{metric: value}`` of ``eval_fn`` over ``batches`` (all real examples)."""
    acc, layout, n = None, None, 0
    for batch in batches:
        if acc is None:
            layout, acc = zeros.get(eval_fn.metrics_fn, state, batch)
        acc = strategy.run(eval_fn, args=(state, acc, batch))
        n += 1
        if steps is not None and n >= steps:
            break
    if acc is None or layout is None:
        raise ValueError("The evaluation data yielded no batches. Expected at least one batch.")
    summed = layout.unpack(jax.device_get(strategy.reduce("sum", acc)))
    return {k: m.compute() for k, m in summed.items()}


def predict_loop(
    strategy: Strategy, predict_fn: Any, state: Any, batches: Iterable[Any], steps: int | None
) -> Any:
    """The concatenated per-example outputs of ``predict_fn``, padded rows dropped."""
    outs = []
    for batch in batches:
        out, mask = strategy.run(predict_fn, args=(state, batch))
        outs.append(strategy.gather((out, mask), axis=0))
        if steps is not None and len(outs) >= steps:
            break
    if not outs:
        raise ValueError("The prediction data yielded no batches. Expected at least one.")
    parts = []
    for out, mask in jax.device_get(outs):
        if mask is not None:
            keep = np.asarray(mask) > 0
            out = jax.tree.map(lambda x, keep=keep: np.asarray(x)[keep], out)
        parts.append(out)
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)
