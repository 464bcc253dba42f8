"""Mixture of experts: top-k routing, grouped matmuls that drop no token, and experts
split over the replica's ``"expert"`` axis with the tokens split over every data axis.

:func:`moe` is the layer a model calls; :func:`route` is its router
(``moe_routing.py``, with the balancing bias); ``moe_exchange.py`` moves the tokens.
Where the layer runs decides how it runs:

* no ``"expert"`` axis of size > 1 in the context mesh (plain ``jax.jit``, one device, a
  replica without that axis): every expert on every device. The ``T x k`` (token,
  choice) pairs are sorted by expert and each expert weight is one
  ``jax.lax.ragged_dot`` over the sorted rows, so no token is dropped (a grouped kernel
  on GPUs; XLA:CPU computes every group's weight over every row, ``E / k`` times the
  FLOPs: benchmarks/experts.py);
* inside a step whose replica has ``devices_per_replica={"expert": X, ...}``: a
  ``shard_map`` manual over the **token axes**: ``"expert"`` and, where the mesh has
  them, ``"fsdp"`` and ``"context"`` (other axes, such as ``"tensor"``, stay with XLA's
  partitioner). The call's tokens split over all of them (``T_d = T / (X F C)`` per
  device, fewer as the mesh grows), each device holds ``E / X`` experts (lay the expert
  weights out with a ``P("expert")`` rule on their leading dimension; a split of their
  other dimensions is gathered on entry, as FSDP does), and each token travels to the
  devices of its experts within its ``"expert"`` group and back. The exchange
  (``exchange=``) is **padded** on CPU (``X x T_d k`` rows each way, the most one
  device could receive) and **ragged** (``jax.lax.ragged_all_to_all``, only the pairs)
  on GPUs and TPUs; a per-device capacity (``capacity_group="device"``) bounds every
  buffer to ``ceil(c T_d k / E)`` rows per expert.

The results equal the one-device layer's: routing, a ``"call"`` capacity and the
statistics are decided over the tokens of the call in their order (under the axes,
counts from earlier devices are gathered first). A ``"device"`` capacity is decided over
each device's tokens (GShard's groups): what it drops depends on the layout.

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
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from distrain._src.nn.moe_exchange import expert_parallel, mlp
from distrain._src.nn.moe_routing import (
    Score,
    combine,
    kept,
    route,
    routed_pairs,
    statistics,
    update_selection_bias,
)

__all__ = ["moe", "route", "update_selection_bias"]

CapacityGroup = Literal["call", "device"]
Exchange = Literal["auto", "padded", "ragged"]
_EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")
# The axes a replica's rows (and a sequence, "context") split over: the layer splits its
# tokens over those the mesh has, so the tokens per device fall as the mesh grows.
TOKEN_AXES = ("fsdp", "expert", "context")


def moe(
    x: jax.Array,
    params: dict[str, Any],
    *,
    top_k: int,
    score: Score = "softmax",
    renormalize: bool = True,
    capacity_factor: float | None = None,
    capacity_group: CapacityGroup = "call",
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    axis: str = "expert",
    exchange: Exchange = "auto",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A mixture-of-experts MLP applied to every token of ``x``.

    Args:
      x: ``[..., D]`` tokens.
      params: ``"router"`` ``[D, E]``; ``"w_in"`` ``[E, D, F]`` and ``"w_out"``
        ``[E, F, D]``; optionally ``"w_gate"`` ``[E, D, F]`` (a gated expert,
        ``activation(x w_gate) * (x w_in)``, SwiGLU with ``jax.nn.silu``),
        ``"selection_bias"`` ``[E]`` (DeepSeek-V3's balancing: added to the scores to
        choose the experts, not to weigh them; :func:`update_selection_bias`) and
        ``"shared"``, a dense expert every token goes through (DeepSeek): ``{"w_in":
        [D, Fs], "w_out": [Fs, D]}`` with an optional ``"w_gate"`` ``[D, Fs]``.
      top_k: experts per token (1 <= top_k <= E).
      score, renormalize: the router's (see :func:`route`).
      capacity_factor: ``None`` (default): dropless. A number ``c > 0``: each expert
        takes at most ``ceil(c n k / E)`` choices of a group of ``n`` tokens, the first
        in token order; the rest are dropped (they add nothing; the residual carries
        the token).
      capacity_group: the group a capacity counts over: ``"call"`` (default: all the
        call's tokens, whatever the layout) or ``"device"`` (each device's tokens on the
        expert axes, GShard's groups: every exchange buffer is bounded by
        ``ceil(c T_d k / E)`` rows per expert; without an expert axis, the call).
      activation: the experts' nonlinearity.
      axis: the mesh axis the experts split over.
      exchange: ``"auto"`` (ragged on GPUs and TPUs, else padded), ``"padded"`` or
        ``"ragged"`` (on CPU its wiring runs over a padded emulation of the collective).

    Returns:
      ``(y, stats)``: ``y`` of ``x``'s shape and dtype; ``stats`` float32
      ``{"load_balancing_loss", "router_z_loss", "dropped_fraction"}`` scalars and
      ``"expert_load"`` ``[E]`` (sums to 1).

    Raises:
      ValueError: ``top_k`` outside ``[1, E]``, a capacity factor <= 0, an unknown
        score, capacity group or exchange, weights whose shapes disagree, or experts
        (or tokens) that the ``"expert"`` axis does not divide; each message names
        the fix.
    """
    experts = _check(x, params, top_k, score, capacity_factor)
    _check_choice("capacity_group", capacity_group, ("call", "device"))
    _check_choice("exchange", exchange, ("auto", "padded", "ragged"))
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    weights = {k: params[k] for k in _EXPERT_WEIGHTS if k in params}
    bias = params.get("selection_bias")
    route_kw = {"top_k": top_k, "score": score, "renormalize": renormalize}
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    if sizes.get(axis, 1) == 1:
        capacity = _capacity(capacity_factor, x2.shape[0], top_k, experts)
        y, stats = _local(x2, params["router"], weights, bias, route_kw, capacity, activation)
    else:
        y, stats = _over_axes(
            x2, params["router"], weights, bias, route_kw, mesh, axis, experts,
            {"factor": capacity_factor, "group": capacity_group, "act": activation,
             "exchange": exchange},
        )  # fmt: skip
    if "shared" in params:
        y = y + _dense(x2, params["shared"], activation)
    return y.reshape(x.shape), stats


def _capacity(factor: float | None, tokens: int, k: int, experts: int) -> int | None:
    return None if factor is None else math.ceil(factor * tokens * k / experts)


def token_axes(mesh: Any, axis: str, tokens: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(axes, auto)``: the axes the layer splits ``tokens`` over, in the call's token
    order (the ones already manual first, ``"context"`` last: a sequence splits inside
    the rows), and those of them it makes manual. An axis whose split the tokens do not
    divide is left out (the expert axis aside: its size must divide them)."""
    shape = dict(mesh.shape)
    manual = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Manual
    }
    order = [a for a in mesh.axis_names if (a in TOKEN_AXES or a == axis) and shape[a] > 1]
    order.sort(key=lambda a: (a not in manual, a == "context"))
    auto: list[str] = []
    for a in order:
        if a in manual:
            continue
        if a == axis or tokens % (shape[a] * math.prod(shape[b] for b in auto)) == 0:
            auto.append(a)
    axes = tuple(a for a in order if a in manual or a in auto)
    return axes, tuple(auto)


def _over_axes(
    x: jax.Array,
    router: jax.Array,
    w: dict[str, jax.Array],
    bias: jax.Array | None,
    route_kw: dict[str, Any],
    mesh: Any,
    axis: str,
    experts: int,
    opts: dict[str, Any],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The layer under a ``shard_map`` manual over the token axes (``moe_exchange``)."""
    tokens = x.shape[0]
    sizes = dict(mesh.shape)
    size = sizes[axis]
    axes, auto = token_axes(mesh, axis, tokens)
    split = math.prod(sizes[a] for a in auto)
    if experts % size or tokens % split:
        raise ValueError(
            f"moe: the {axis!r} axis has {size} devices; they must divide the experts "
            f"({experts}) and the tokens ({tokens}). Use a multiple of {size} experts "
            f"(and a batch whose tokens it divides), or another {axis!r} size."
        )
    group = opts["group"]
    per_device = tokens // split
    capacity = _capacity(
        opts["factor"], per_device if group == "device" else tokens * _manual(sizes, axes, auto),
        route_kw["top_k"], experts,
    )  # fmt: skip
    body_opts = {
        "route_kw": route_kw, "capacity": capacity, "group": group, "act": opts["act"],
        "exchange": opts["exchange"], "sizes": sizes,
    }  # fmt: skip

    def body(x_l: jax.Array, r: jax.Array, w_l: dict[str, jax.Array], b: Any) -> Any:
        return expert_parallel(x_l, r, w_l, b, body_opts, axis, axes)

    if not auto:
        return body(x, router, w, bias)
    weight_spec = P(axis) if axis in auto else P()
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(auto), P(), {k: weight_spec for k in w}, P()),
        out_specs=(P(auto), P()),
        axis_names=set(auto),
        check_vma=False,
    )(x, router, w, bias)


def _manual(sizes: dict[str, int], axes: tuple[str, ...], auto: tuple[str, ...]) -> int:
    """How many devices of the already-manual token axes the call's tokens span."""
    return math.prod(sizes[a] for a in axes if a not in auto)


def _dense(x: jax.Array, w: dict[str, jax.Array], act: Callable) -> jax.Array:
    dt = x.dtype
    h = x @ w["w_in"].astype(dt)
    h = act(x @ w["w_gate"].astype(dt)) * h if "w_gate" in w else act(h)
    return h.astype(dt) @ w["w_out"].astype(dt)


def _local(
    x: jax.Array,
    router: jax.Array,
    w: dict[str, jax.Array],
    bias: jax.Array | None,
    route_kw: dict[str, Any],
    capacity: int | None,
    act: Callable,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Every expert here: sort, one ragged_dot per weight, unsort."""
    experts, weights, tokens, sizes, scores, z = routed_pairs(x, router, bias, route_kw)
    keep = kept(experts, sizes, jnp.zeros_like(sizes), capacity)
    y = combine(x, mlp(x[tokens], sizes, w, act), weights * keep, tokens)
    k = route_kw["top_k"]
    stats = statistics(sizes, jnp.sum(scores, 0), z, jnp.sum(~keep), x.shape[0], k)
    return y, stats


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"moe: {name} must be one of {list(choices)}. Received: {value!r}.")


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
    bias = params.get("selection_bias")
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(
            f"moe: params['selection_bias'] must be [E] = [{e}] (one per expert). "
            f"Received shape {tuple(bias.shape)}."
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
