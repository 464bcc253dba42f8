"""Delayed Nesterov, the outer optimizer of asynchronous islands (an optax transform).

Synchronous DiLoCo averages every island's pseudo-gradient before one outer step
(``outer_step.py``); asynchronous islands (``island.py``) send theirs one at a time,
each from a different global step. Liu et al. 2024 ("Asynchronous Local-SGD Training
for Language Modeling") apply each arrival at once and move the momentum only once per
``delay`` arrivals, so that stale pseudo-gradients do not each push the momentum.

Example:
  >>> tx = delayed_nesterov(0.7, 0.9, delay=4)
  >>> state = tx.init({"w": jnp.zeros(())})
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["DelayedNesterovState", "delayed_nesterov"]


class DelayedNesterovState(NamedTuple):
    """:func:`delayed_nesterov`'s state: arrivals counted, the momentum, the buffer."""

    arrivals: jax.Array
    momentum: Any
    buffer: Any


def delayed_nesterov(
    learning_rate: float, momentum: float = 0.9, delay: int = 1
) -> optax.GradientTransformation:
    """Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
    Modeling"): the outer optimizer of asynchronous islands.

    Each pseudo-gradient ``g`` is applied as it arrives, ``-lr * g / delay``; the
    momentum moves only every ``delay``-th arrival, with the mean of the last ``delay``
    pseudo-gradients, and its Nesterov term ``-lr * momentum * m`` is applied then. Over
    ``delay`` arrivals that is one Nesterov SGD step on their mean, so with ``delay=1``
    it equals ``optax.sgd(lr, momentum, nesterov=True)``; with ``delay`` = the number of
    islands, one momentum step per "round" of arrivals, however stale.

    Example:
      >>> tx = delayed_nesterov(0.7, 0.9, delay=4)
    """
    if delay < 1:
        raise ValueError(f"delayed_nesterov needs delay >= 1. Received: delay={delay!r}.")

    def init(params: Any) -> DelayedNesterovState:
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(
        grads: Any, state: DelayedNesterovState, params: Any = None
    ) -> tuple[Any, DelayedNesterovState]:
        del params
        arrivals = state.arrivals + 1
        boundary = arrivals % delay == 0
        buffer = jax.tree.map(lambda b, g: b + g.astype(jnp.float32), state.buffer, grads)
        mom = jax.tree.map(
            lambda m, b: jnp.where(boundary, momentum * m + b / delay, m), state.momentum, buffer
        )
        updates = jax.tree.map(
            lambda g, m: (
                -learning_rate * g.astype(jnp.float32) / delay
                - jnp.where(boundary, learning_rate * momentum * m, 0.0)
            ).astype(g.dtype),
            grads,
            mom,
        )
        buffer = jax.tree.map(lambda b: jnp.where(boundary, jnp.zeros_like(b), b), buffer)
        return updates, DelayedNesterovState(arrivals, mom, buffer)

    return optax.GradientTransformation(init, update)
