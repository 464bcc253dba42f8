"""Routing for :func:`distrain.nn.moe`: which experts each token goes to, what a capacity
keeps, the routing statistics, and the auxiliary-loss-free balancing bias.

The router scores every (token, expert) pair (softmax or sigmoid of ``x @ router``) and
each token goes to its ``top_k`` best experts. The pairs are then sorted by expert
(token order within one): the order the grouped matmuls and the exchange read them in.

**Balancing without an auxiliary loss** (DeepSeek-V3, arXiv:2412.19437 section 2.1.2):
a per-expert ``selection_bias`` ``[E]`` is added to the scores *to choose* the experts
only; a chosen expert's weight is its unbiased score, so the bias changes which experts
a token reaches, never the output of a chosen expert. After each step the bias moves by
a fixed ``rate`` towards balance (:func:`update_selection_bias`): up for an expert
loaded below the mean, down above it. It is state, not a parameter: no gradient reaches
it and the optimizer must not touch it.

Example:
  >>> w, e, scores = route(logits, 2)                        # [T, 2], [T, 2], [T, E]
  >>> w, e, _ = route(logits, 2, selection_bias=bias)         # chosen by scores + bias
  >>> bias = update_selection_bias(bias, stats["expert_load"], rate=1e-3)
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

__all__ = ["route", "update_selection_bias"]

Score = Literal["softmax", "sigmoid"]


def route(
    logits: jax.Array,
    top_k: int,
    *,
    score: Score = "softmax",
    renormalize: bool = True,
    selection_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's ``top_k`` experts and their weights, from router logits ``[T, E]``.

    Args:
      logits: ``[T, E]`` router logits (computed in float32 here).
      top_k: experts per token.
      score: ``"softmax"`` (Switch, Mixtral) or ``"sigmoid"`` (DeepSeek-V3) scores.
      renormalize: divide the chosen scores by their sum (Mixtral; DeepSeek-V3 with
        sigmoid); ``False`` keeps the raw scores (Switch).
      selection_bias: optional ``[E]`` added to the scores to choose the experts only
        (DeepSeek-V3's balancing); the weights are the unbiased scores.

    Returns:
      ``(weights [T, k] float32, experts [T, k] int32, scores [T, E] float32)``: the
      ``k`` best experts by (biased) score, best first.

    Example:
      >>> w, e, _ = route(jnp.zeros((3, 4)).at[:, 1].set(1.0), 1)
      >>> e[:, 0]
      Array([1, 1, 1], dtype=int32)
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    if selection_bias is None:
        weights, experts = jax.lax.top_k(scores, top_k)
    else:
        # The bias is a choice, not a signal: stop_gradient keeps it out of every gradient.
        biased = scores + jax.lax.stop_gradient(selection_bias).astype(jnp.float32)
        experts = jax.lax.top_k(biased, top_k)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), scores


def update_selection_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's update of the balancing bias: ``bias + rate * sign(mean - load)``.

    Args:
      bias: ``[E]`` (or ``[..., E]``, one per layer) the current bias.
      expert_load: the share of the choices each expert took (``stats["expert_load"]``,
        same shape as ``bias``).
      rate: the step ``gamma`` (DeepSeek-V3: 0.001).

    Returns:
      The new bias, float32: each underloaded expert up by ``rate``, each overloaded
      one down by ``rate``, a balanced one unchanged.

    Example:
      >>> update_selection_bias(jnp.zeros(4), jnp.array([0.4, 0.1, 0.25, 0.25]), 0.01)
      Array([-0.01,  0.01,  0.  ,  0.  ], dtype=float32)
    """
    load = expert_load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return bias.astype(jnp.float32) + rate * jnp.sign(mean - load)


def routed_pairs(
    x: jax.Array, router: jax.Array, bias: jax.Array | None, route_kw: dict[str, Any]
) -> tuple[jax.Array, ...]:
    """The call's (token, choice) pairs sorted by expert (token order within one):
    ``(experts, weights, tokens)`` of the sorted pairs, ``sizes`` [E] (pairs per expert),
    the scores ``[T, E]`` and the sum of squared router log-normalisers (the z-loss's)."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    weights, chosen, scores = route(logits, **route_kw, selection_bias=bias)
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
    flat_e = chosen.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    sizes = jnp.bincount(flat_e, length=router.shape[-1]).astype(jnp.int32)
    tokens = order // route_kw["top_k"]
    return flat_e[order], weights.reshape(-1)[order], tokens, sizes, scores, z


def ranks(sorted_e: jax.Array, sizes: jax.Array) -> jax.Array:
    """Each sorted pair's place among its expert's pairs here (0 for the first)."""
    starts = jnp.cumsum(sizes) - sizes
    return jnp.arange(sorted_e.shape[0]) - starts[sorted_e]


def kept(sorted_e: jax.Array, sizes: jax.Array, before: Any, capacity: int | None) -> jax.Array:
    """Which choices (sorted by expert, token order within one) an expert takes: its
    first ``capacity`` (``before``: its choices earlier in the capacity's group)."""
    if capacity is None:
        return jnp.ones(sorted_e.shape, bool)
    return ranks(sorted_e, sizes) + before[sorted_e] < capacity


def statistics(
    counts: jax.Array,
    score_sums: jax.Array,
    z_sum: jax.Array,
    dropped: jax.Array,
    tokens: int,
    k: int,
) -> dict[str, jax.Array]:
    """The layer's statistics from sums over the call's ``tokens`` (see ``moe``)."""
    load = counts.astype(jnp.float32) / (tokens * k)
    mean_score = score_sums / tokens
    return {
        "load_balancing_loss": counts.shape[0] * jnp.sum(load * mean_score),
        "router_z_loss": z_sum / tokens,
        "dropped_fraction": dropped.astype(jnp.float32) / (tokens * k),
        "expert_load": load,
    }


def combine(x: jax.Array, ys: jax.Array, weights: jax.Array, tokens: jax.Array) -> jax.Array:
    """Each token's output: its pairs' expert outputs ``ys`` weighted and summed."""
    return jnp.zeros_like(x).at[tokens].add(ys * weights.astype(ys.dtype)[:, None])
