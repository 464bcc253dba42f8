"""Gradient accumulation: ``k`` micro-batches per optimizer update, in one program.

:func:`accumulate_gradients` turns a per-replica ``train_step(state, batch)`` into one
that splits its batch into ``k`` micro-batches and runs the step on each inside a
``lax.scan`` (activations of one micro-batch alive at a time), with two changes that
make the result equal one step on the whole batch:

* ``dt.compute_average_loss`` (told by the micro-step's replica context,
  ``ReplicaContext.micro_steps``) divides by the whole update's global batch (``k`` times
  the micro-batch's), or, with a mask, by the number of real rows of the whole update
  (the sum of ``batch[mask_key]`` over all micro-batches and replicas, computed once
  up front) - not by each micro-batch's own count, whose average is biased when
  micro-batches hold different numbers of real rows;
* ``state.apply_gradients(grads=...)`` keeps the gradients instead of applying them
  (the micro-step's state has ``accumulating=True``; they come back in its
  ``micro_grads``); their sum is applied once at the end (one all-reduce, one
  optimizer update).

``Trainer(grad_accum_steps=k)`` uses it; custom loops call it directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from distrain._src import context
from distrain._src.context import MicroSteps
from distrain._src.padding import MASK_KEY
from distrain._src.train import _functions
from distrain._src.train import metrics as metrics_lib
from distrain._src.train.state import TrainState
from distrain._src.validate import positive_int


def accumulate_gradients(
    train_step: Callable[..., Any], steps: int, *, mask_key: str | None = MASK_KEY
) -> Callable[..., Any]:
    """A per-replica step running ``train_step`` on ``steps`` micro-batches of its batch.

    Args:
      train_step: ``train_step(state, batch) -> (state, metrics)`` with ``state`` a
        ``dt.TrainState`` whose ``apply_gradients`` it calls once.
      steps: ``k``, micro-batches per update; each replica's batch rows must divide by it.
      mask_key: the batch key of the 0/1 mask of real rows, if batches carry one.

    Returns:
      ``step(state, batch) -> (state, metrics)``: one optimizer update; the metrics of
      the micro-steps are merged (``dt.metrics`` objects exactly; a plain scalar becomes
      its mean over the micro-steps; the value of ``dt.compute_average_loss`` becomes a
      ``dt.metrics.Mean`` whose sum over replicas gives the update's mean loss).

    Raises:
      TypeError / ValueError: a state that is not a TrainState, rows not divisible by
        ``steps``, a step that never applies gradients.

    Example:
      >>> step = dt.accumulate_gradients(train_step, 4)    # 4 micro-batches per update
      >>> state, metrics = strategy.run(step, args=(state, batch))
    """
    steps = positive_int("steps", steps)
    if steps == 1:
        return train_step

    @functools.wraps(train_step)  # errors name the user's step
    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        if not isinstance(state, TrainState):
            raise TypeError(
                "Gradient accumulation needs a dt.TrainState as the state (its "
                f"apply_gradients is what accumulates). Received: {type(state).__name__}."
            )
        rows = {x.shape[0] for x in jax.tree.leaves(batch)}
        if len(rows) != 1 or next(iter(rows)) % steps:
            raise ValueError(
                f"Each replica's batch must split into {steps} equal micro-batches: its "
                f"leaves have {sorted(rows)} rows. Use a per-replica batch divisible by "
                f"{steps} (global batch = replicas x {steps} x micro-batch)."
            )
        micro = jax.tree.map(lambda x: x.reshape(steps, x.shape[0] // steps, *x.shape[1:]), batch)
        ctx = context.get_replica_context()
        total = None
        if mask_key is not None and isinstance(batch, Mapping) and mask_key in batch:
            total = jnp.sum(jnp.asarray(batch[mask_key], jnp.float32))
            if ctx is not None:
                total = ctx.all_reduce("sum", total)
        # What a micro-step does differently is explicit: its replica context tells
        # compute_average_loss the whole update's batch, its state tells apply_gradients
        # to keep the gradients (TrainState.accumulating).
        micro_steps = MicroSteps(steps, mask_key, total)
        micro_ctx = ctx.with_micro_steps(micro_steps) if ctx is not None else None
        # Only the trainable parameters' gradients are kept (frozen ones: None).
        trained = state.select_trainable(state.params)
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), trained)

        def body(carry: Any, mb: Any) -> tuple[Any, Any]:
            st, acc = carry
            with context._enter_replica(micro_ctx), context._recording_shares():
                out = train_step(st.replace(accumulating=True), mb)
                new, metrics = _functions.check_pair(train_step, out)
                metrics = _as_metrics(metrics)
            if not isinstance(new, TrainState) or new.micro_grads is None:
                raise ValueError(
                    "The step never called `state.apply_gradients(grads=...)`, so there is "
                    "nothing to accumulate."
                )
            acc = jax.tree.map(lambda a, g: a + jnp.asarray(g, jnp.float32), acc, new.micro_grads)
            return (new.replace(accumulating=False, micro_grads=None), acc), metrics

        (state, grads), metrics = jax.lax.scan(body, (state, zeros), micro)
        # Every leaf of a metric is a sum: summing over the micro-steps merges them.
        merged = jax.tree.map(lambda m: jnp.sum(m, 0), metrics)
        return state.apply_gradients(grads=grads), merged

    return step


def _as_metrics(metrics: Any) -> Any:
    """Plain scalars as ``Mean``s, so that summing merges them (a loss share counts
    ``1/(replicas x steps)``, so its micro-steps sum to the update's mean)."""

    def one(x: Any) -> Any:
        if isinstance(x, metrics_lib.Metric):
            return x
        return metrics_lib.from_scalar(x)

    return jax.tree.map(one, metrics, is_leaf=lambda x: isinstance(x, metrics_lib.Metric))
