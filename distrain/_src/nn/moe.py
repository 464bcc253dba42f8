"""Mixture of experts: top-k routing, grouped matmuls that drop no token, and experts
split over the replica's ``"expert"`` axis.

:func:`moe` is the layer a model calls; :func:`route` is its router. Where the layer runs
decides how it runs:

* no ``"expert"`` axis of size > 1 in the context mesh (plain ``jax.jit``, one device, a
  replica without that axis): every expert on every device. The ``T x k`` (token,
  choice) pairs are sorted by expert and each expert weight is one
  ``jax.lax.ragged_dot`` over the sorted rows, so no token is dropped (a grouped kernel
  on GPUs; XLA:CPU computes every group's weight over every row, ``E / k`` times the
  FLOPs: benchmarks/experts.py);
* inside a step whose replica has ``devices_per_replica={"expert": X, ...}``: a
  ``shard_map`` manual over ``"expert"`` only (other axes stay with XLA's partitioner).
  Each device holds ``E / X`` experts (lay the expert weights out with a ``P("expert")``
  rule on their leading dimension) and ``T / X`` of the tokens; each token travels to
  the devices of its experts and back with one ``all_to_all`` each way. The exchange
  is **padded**: ``T / X * k`` rows to every device, the most one device could be sent
  (XLA:CPU has no ragged all-to-all), so an all-to-all moves ``X`` times the rows that
  carry tokens and the grouped matmuls run over the padding too (its rows are zeros).

The results equal the one-device layer's: routing, capacity and statistics are decided
over the tokens of the call in their order (under the axis, counts from earlier devices
are gathered first).

Statistics (returned, for the step to add or log): the Switch Transformer's
load-balancing loss ``E * sum_e f_e * p_e`` (``f_e``: the share of the ``T x k`` choices
that went to expert ``e``; ``p_e``: its mean router probability; 1.0 when balanced), the
router z-loss ``mean(logsumexp(logits)^2)``, the share of choices dropped by a capacity
and each expert's load ``f``. They are over the tokens of the call: in a step, the
replica's own batch (each replica balances its own tokens; the gradient all-reduce then
averages the losses' gradients as it averages the model loss's).

Example:
  >>> params = {"router": r, "w_in": w_in, "w_out": w_out}    # [D, E], [E, D, F], [E, F, D]
  >>> y, stats = dt.nn.moe(x, params, top_k=2)
  >>> loss = task_loss + 0.01 * stats["load_balancing_loss"] + 1e-3 * stats["router_z_loss"]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distrain._src.nn.attention import _axis

__all__ = ["moe", "route"]

Score = Literal["softmax", "sigmoid"]
_EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")


def route(
    logits: jax.Array, top_k: int, *, score: Score = "softmax", renormalize: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's ``top_k`` experts and their weights, from router logits ``[T, E]``.

    Args:
      logits: ``[T, E]`` router logits (computed in float32 here).
      top_k: experts per token.
      score: ``"softmax"`` (Switch, Mixtral) or ``"sigmoid"`` (DeepSeek-V3) scores.
      renormalize: divide the chosen scores by their sum (Mixtral; DeepSeek-V3 with
        sigmoid); ``False`` keeps the raw scores (Switch).

    Returns:
      ``(weights [T, k] float32, experts [T, k] int32, scores [T, E] float32)``: the
      ``k`` best experts by score, best first.
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    weights, experts = jax.lax.top_k(scores, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), scores


def moe(
    x: jax.Array,
    params: dict[str, Any],
    *,
    top_k: int,
    score: Score = "softmax",
    renormalize: bool = True,
    capacity_factor: float | None = None,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    axis: str = "expert",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A mixture-of-experts MLP applied to every token of ``x``.

    Args:
      x: ``[..., D]`` tokens.
      params: ``"router"`` ``[D, E]``; ``"w_in"`` ``[E, D, F]`` and ``"w_out"``
        ``[E, F, D]``; optionally ``"w_gate"`` ``[E, D, F]`` (a gated expert,
        ``activation(x w_gate) * (x w_in)``, SwiGLU with ``jax.nn.silu``) and
        ``"shared"``, a dense expert every token goes through (DeepSeek): ``{"w_in":
        [D, Fs], "w_out": [Fs, D]}`` with an optional ``"w_gate"`` ``[D, Fs]``.
      top_k: experts per token (1 <= top_k <= E).
      score, renormalize: the router's (see :func:`route`).
      capacity_factor: ``None`` (default): dropless. A number ``c > 0``: each expert
        takes at most ``ceil(c T k / E)`` choices, the first in token order; the rest
        are dropped (they add nothing; the residual carries the token).
      activation: the experts' nonlinearity.
      axis: the mesh axis the experts split over.

    Returns:
      ``(y, stats)``: ``y`` of ``x``'s shape and dtype; ``stats`` float32
      ``{"load_balancing_loss", "router_z_loss", "dropped_fraction"}`` scalars and
      ``"expert_load"`` ``[E]`` (sums to 1).

    Raises:
      ValueError: ``top_k`` outside ``[1, E]``, a capacity factor <= 0, an unknown
        score, weights whose shapes disagree, or experts (or tokens) that the
        ``"expert"`` axis does not divide; each message names the fix.
    """
    experts = _check(x, params, top_k, score, capacity_factor)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    tokens = x2.shape[0]
    capacity = (
        None if capacity_factor is None else math.ceil(capacity_factor * tokens * top_k / experts)
    )
    size, manual = _axis(axis)
    weights = {k: params[k] for k in _EXPERT_WEIGHTS if k in params}
    route_kw = {"top_k": top_k, "score": score, "renormalize": renormalize}
    if size == 1:
        y, stats = _local(x2, params["router"], weights, route_kw, capacity, activation)
    else:
        if experts % size or (not manual and tokens % size):
            raise ValueError(
                f"moe: the {axis!r} axis has {size} devices; they must divide the experts "
                f"({experts}) and the tokens ({tokens}). Use a multiple of {size} experts "
                f"(and a batch whose tokens it divides), or another {axis!r} size."
            )

        def body(x_l: jax.Array, router: jax.Array, w: dict[str, jax.Array]) -> Any:
            return _split(x_l, router, w, route_kw, capacity, activation, axis, size)

        if manual:
            y, stats = body(x2, params["router"], weights)
        else:
            y, stats = jax.shard_map(
                body,
                mesh=jax.sharding.get_abstract_mesh(),
                in_specs=(P(axis), P(), {k: P(axis) for k in weights}),
                out_specs=(P(axis), P()),
                axis_names={axis},
                check_vma=False,
            )(x2, params["router"], weights)
    if "shared" in params:
        y = y + _dense(x2, params["shared"], activation)
    return y.reshape(x.shape), stats


# ----------------------------------------------------------------------------- kernels


def _mlp(xs: jax.Array, sizes: jax.Array, w: dict[str, jax.Array], act: Callable) -> jax.Array:
    """The experts' MLP over rows ``xs`` sorted by expert (``sizes`` rows each; rows past
    their sum come out zero)."""
    dt = xs.dtype
    h = jax.lax.ragged_dot(xs, w["w_in"].astype(dt), sizes)
    if "w_gate" in w:
        h = act(jax.lax.ragged_dot(xs, w["w_gate"].astype(dt), sizes)) * h
    else:
        h = act(h)
    return jax.lax.ragged_dot(h.astype(dt), w["w_out"].astype(dt), sizes)


def _dense(x: jax.Array, w: dict[str, jax.Array], act: Callable) -> jax.Array:
    dt = x.dtype
    h = x @ w["w_in"].astype(dt)
    h = act(x @ w["w_gate"].astype(dt)) * h if "w_gate" in w else act(h)
    return h.astype(dt) @ w["w_out"].astype(dt)


def _kept(sorted_e: jax.Array, sizes: jax.Array, before: Any, capacity: int | None) -> jax.Array:
    """Which choices (sorted by expert, token order within one) an expert takes:
    its first ``capacity`` over the call's tokens (``before``: its choices on earlier
    devices)."""
    if capacity is None:
        return jnp.ones(sorted_e.shape, bool)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(sorted_e.shape[0]) - starts[sorted_e] + before[sorted_e]
    return rank < capacity


def _stats(
    counts: jax.Array,
    score_sums: jax.Array,
    z_sum: jax.Array,
    dropped: jax.Array,
    tokens: int,
    k: int,
) -> dict[str, jax.Array]:
    load = counts.astype(jnp.float32) / (tokens * k)
    mean_score = score_sums / tokens
    return {
        "load_balancing_loss": counts.shape[0] * jnp.sum(load * mean_score),
        "router_z_loss": z_sum / tokens,
        "dropped_fraction": dropped.astype(jnp.float32) / (tokens * k),
        "expert_load": load,
    }


def _routed(x: jax.Array, router: jax.Array, route_kw: dict[str, Any]) -> Any:
    """The call's (token, choice) pairs sorted by expert (token order within one):
    ``(experts, weights, tokens)`` of the sorted pairs, ``sizes`` [E] (pairs per expert),
    the scores ``[T, E]`` and the sum of squared router log-normalisers (the z-loss's)."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    weights, chosen, scores = route(logits, **route_kw)
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
    flat_e = chosen.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    sizes = jnp.bincount(flat_e, length=router.shape[-1]).astype(jnp.int32)
    tokens = order // route_kw["top_k"]
    return flat_e[order], weights.reshape(-1)[order], tokens, sizes, scores, z


def _combine(x: jax.Array, ys: jax.Array, weights: jax.Array, tokens: jax.Array) -> jax.Array:
    """Each token's output: its pairs' expert outputs ``ys`` weighted and summed."""
    return jnp.zeros_like(x).at[tokens].add(ys * weights.astype(ys.dtype)[:, None])


def _local(
    x: jax.Array,
    router: jax.Array,
    w: dict[str, jax.Array],
    route_kw: dict[str, Any],
    capacity: int | None,
    act: Callable,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Every expert here: sort, one ragged_dot per weight, unsort."""
    experts, weights, tokens, sizes, scores, z = _routed(x, router, route_kw)
    keep = _kept(experts, sizes, jnp.zeros_like(sizes), capacity)
    y = _combine(x, _mlp(x[tokens], sizes, w, act), weights * keep, tokens)
    stats = _stats(sizes, jnp.sum(scores, 0), z, jnp.sum(~keep), x.shape[0], route_kw["top_k"])
    return y, stats


def _split(
    x: jax.Array,
    router: jax.Array,
    w: dict[str, jax.Array],
    route_kw: dict[str, Any],
    capacity: int | None,
    act: Callable,
    axis: str,
    devices: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One device's part under the ``axis`` shard_map: its tokens ``x`` [T / X, D], its
    experts ``w`` [E / X, ...]; tokens go to their experts' devices and back."""
    local_e = router.shape[-1] // devices
    experts, weights, tokens, sizes, scores, z = _routed(x, router, route_kw)
    n = experts.shape[0]  # T / X * k pairs
    every = jax.lax.all_gather(sizes, axis)  # [X, E]: earlier devices' pairs first
    before = jnp.cumsum(every, 0)[jax.lax.axis_index(axis)] - sizes
    keep = _kept(experts, sizes, before, capacity)
    # Where each pair goes: device `dest`, slot `slot` of its block.
    dest = experts // local_e
    per_dest = sizes.reshape(devices, local_e).sum(1)
    slot = jnp.arange(n) - (jnp.cumsum(per_dest) - per_dest)[dest]
    send = jnp.zeros((devices, n, x.shape[-1]), x.dtype).at[dest, slot].set(x[tokens])
    ids = jnp.full((devices, n), local_e, jnp.int32).at[dest, slot].set(experts % local_e)
    got = jax.lax.all_to_all(send, axis, 0, 0, tiled=True).reshape(devices * n, -1)
    got_ids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True).reshape(-1)
    # Here: group what arrived by local expert (padding, id local_e, last: zeros).
    by_expert = jnp.argsort(got_ids, stable=True)
    here = jnp.bincount(got_ids, length=local_e + 1)[:local_e].astype(jnp.int32)
    out = _mlp(got[by_expert], here, w, act)
    out = jnp.zeros_like(out).at[by_expert].set(out).reshape(devices, n, -1)
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # block d: what d computed
    y = _combine(x, back[dest, slot], weights * keep, tokens)
    total = lambda v: jax.lax.psum(v, axis)  # noqa: E731
    stats = _stats(
        total(sizes),
        total(jnp.sum(scores, 0)),
        total(z),
        total(jnp.sum(~keep)),
        x.shape[0] * devices,
        route_kw["top_k"],
    )
    return y, stats


def _check(x: jax.Array, params: Any, top_k: Any, score: Any, capacity_factor: Any) -> int:
    """The number of experts, after checking the arguments agree."""
    missing = [k for k in ("router", "w_in", "w_out") if k not in params]
    if missing:
        raise ValueError(
            f"moe: params needs 'router' [D, E], 'w_in' [E, D, F] and 'w_out' [E, F, D]; "
            f"missing {missing}. Received keys {sorted(params)}."
        )
    d = x.shape[-1]
    router, w_in, w_out = params["router"], params["w_in"], params["w_out"]
    e = router.shape[-1] if router.ndim == 2 else None
    f = w_in.shape[-1] if w_in.ndim == 3 else None
    shapes = {k: tuple(params[k].shape) for k in ("router", *_EXPERT_WEIGHTS) if k in params}
    if (
        e is None
        or router.shape[0] != d
        or w_in.shape != (e, d, f)
        or w_out.shape != (e, f, d)
        or ("w_gate" in params and params["w_gate"].shape != (e, d, f))
    ):
        raise ValueError(
            f"moe: for tokens of width D={d}, expected router [D, E], w_in and w_gate "
            f"[E, D, F], w_out [E, F, D] with the same E and F. Received {shapes}."
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(
            f"moe: top_k must be an int from 1 to the number of experts ({e}). Received: {top_k!r}."
        )
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"moe: score must be 'softmax' or 'sigmoid'. Received: {score!r}.")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            "moe: capacity_factor must be a number > 0 (1.0: each expert takes its even "
            f"share of the choices), or None for dropless routing. Received: {capacity_factor!r}."
        )
    shared = params.get("shared")
    if shared is not None:
        fs = shared["w_in"].shape[-1] if "w_in" in shared else None
        if (
            "w_out" not in shared
            or shared["w_in"].shape != (d, fs)
            or shared["w_out"].shape != (fs, d)
            or ("w_gate" in shared and shared["w_gate"].shape != (d, fs))
        ):
            raise ValueError(
                "moe: params['shared'] must be {'w_in': [D, Fs], 'w_out': [Fs, D]} (and "
                f"optionally 'w_gate' [D, Fs]) with D={d}. Received "
                f"{ {k: tuple(v.shape) for k, v in shared.items()} }."
            )
    return int(e)
