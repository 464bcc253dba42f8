"""``dt.nn.pipeline``: a stack of layers split into pipeline stages over a ``"stage"`` axis.

``pipeline(layer_fn, stacked_params, x, microbatches=M)`` applies ``L`` layers,
``x = layer_fn(params[l], x)`` for ``l = 0 .. L-1``, where ``stacked_params`` holds every
layer's parameters with a leading layer dimension (the ``jax.lax.scan`` / ``nnx.scan``
layout). Where the replica's mesh has no ``"stage"`` axis (or it has size 1) this is a
plain ``lax.scan`` over the layers. Over a ``"stage"`` axis of ``S`` devices it is
GPipe: the layers go to stages, the batch is cut into ``M`` microbatches that move from
stage to stage every tick (``lax.ppermute`` around the ring), and the backward pass is
the gradient of that schedule.

Schedule. With ``repeats=R`` the layers are cut into ``S * R`` chunks of ``K = L / (S R)``
consecutive layers and chunk ``c`` lives on stage ``c % S`` (``R = 1``: stage ``s`` holds
layers ``s K .. s K + K - 1``; ``R > 1``: the circular schedule, each microbatch goes
around the ring ``R`` times). Microbatches enter in groups of ``S``: microbatch
``m = g S + j`` makes its ``v``-th chunk visit (``v = r S + s``) at tick
``g S R + j + v``, so no stage is ever asked for two things at once, and a step takes
``M R + S - 1`` ticks of which ``S - 1`` are the fill and drain bubble:
``(S - 1) / (M R + S - 1)`` of the time.

Memory. Each stage holds ``1/S`` of the stacked parameters (lay them out with a
``P("stage")`` rule on their leading dimension; other layouts are resharded, correct but
slower) and, for the backward pass, its activations for every tick (``remat=True``
keeps only each chunk's input and recomputes the rest). When ``M`` is a multiple of
``S`` the output stays split over the stages (stage ``o`` keeps microbatches
``o M/S .. (o + 1) M/S - 1``): no stage holds all of it, and nothing is all-reduced;
otherwise the last stage's outputs are all-reduced over ``axis``.

Per-row values every layer reads and none changes (a transformer's segment ids,
positions or rotary tables) go in ``aux``: they are cut into the same microbatches, and
every stage indexes its current microbatch's part (``aux`` is whole on each stage, so
nothing of it travels around the ring); ``layer_fn(params_l, x, aux)`` then takes three
arguments.

Not supported (yet): 1F1B and zero-bubble schedules, which interleave backward and
forward passes of different microbatches (they need a hand-written backward pass, not
``jax.grad`` of the forward schedule), and stages of different shapes.

Example:
  >>> def layer(p, x):
  ...     return jnp.tanh(x @ p["w"] + p["b"])
  >>> y = dt.nn.pipeline(layer, {"w": ws, "b": bs}, x, microbatches=8)   # ws: [L, D, D]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

__all__ = ["pipeline"]


def pipeline(
    layer_fn: Callable[..., jax.Array],
    stacked_params: Any,
    x: jax.Array,
    *,
    microbatches: int,
    repeats: int = 1,
    remat: bool | Callable[..., Any] = False,
    axis: str = "stage",
    aux: Any = None,
) -> jax.Array:
    """Applies ``L`` stacked layers to ``x``, pipelined over ``axis`` when the replica has it.

    Args:
      layer_fn: ``layer_fn(params_l, x) -> x`` (``layer_fn(params_l, x, aux)`` with
        ``aux``), one layer; its output has ``x``'s shape and dtype.
      stacked_params: a pytree whose leaves have a leading layer dimension ``L``.
      x: the batch, ``[B, ...]``.
      microbatches: ``M``, how many pieces the batch is cut into (``B % M == 0``).
      repeats: ``R``, chunks per stage (circular schedule); ``L % (S R) == 0`` and, with
        ``R > 1``, ``M % S == 0``.
      remat: recompute each chunk's activations in the backward pass
        (``jax.checkpoint``) instead of keeping them: ``True`` keeps only each chunk's
        input; a policy (``jax.checkpoint_policies.dots_saveable``, ...) keeps what it
        names.
      axis: the mesh axis of the stages.
      aux: a pytree of per-row arrays (``[B, ...]``) every layer reads, microbatched
        with ``x``; ``None`` (default): ``layer_fn`` takes two arguments.

    Returns:
      ``x`` after the ``L`` layers (the same values as a ``lax.scan`` over them).

    Raises:
      ValueError: numbers that do not divide (each named), a ``layer_fn`` whose output
        differs from its input in shape or dtype, or parameters without a common
        leading dimension.
      TypeError: ``microbatches`` or ``repeats`` not a positive int, or ``remat``
        neither a bool nor a policy.
    """
    fn = layer_fn if aux is not None else lambda p, h, _: layer_fn(p, h)
    checkpoint = _checkpoint(remat)
    layers = _check(fn, stacked_params, x, aux, microbatches, repeats)
    mesh = jax.sharding.get_abstract_mesh()
    stages = 1 if mesh.empty or axis not in mesh.axis_names else mesh.shape[axis]
    if stages == 1:
        return _scan(checkpoint(fn), stacked_params, x, aux)
    if layers % (stages * repeats):
        raise ValueError(
            f"pipeline: {layers} layers do not split into {stages} stages x {repeats} "
            f"repeats ({stages * repeats} chunks of equal size). Use a number of layers "
            f"divisible by {stages * repeats}, or other stages/repeats."
        )
    if repeats > 1 and microbatches % stages:
        raise ValueError(
            f"pipeline: with repeats={repeats} (the circular schedule) the microbatches "
            f"({microbatches}) must be a multiple of the stages ({stages}): they go round "
            "the ring in groups of one per stage."
        )
    k = layers // (stages * repeats)

    def chunked(a: jax.Array) -> jax.Array:  # [L, ...] -> [S, R, K, ...]; chunk r*S+s
        a = a.reshape(repeats, stages, k, *a.shape[1:])
        return jnp.swapaxes(a, 0, 1)

    params = jax.tree.map(chunked, stacked_params)

    def cut(a: jax.Array) -> jax.Array:  # [B, ...] -> [M, B / M, ...]
        return a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:])

    def chunk(p: Any, h: jax.Array, a: Any) -> jax.Array:
        return _scan(fn, p, h, a)

    # The output stays split over the stages (stage o keeps microbatches o M/S ..
    # (o + 1) M/S - 1) when they divide evenly; otherwise every stage gets all of it.
    split = microbatches % stages == 0
    run = jax.shard_map(
        lambda p, xs, auxs: _schedule(checkpoint(chunk), p, xs, auxs, stages, repeats, axis, split),
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(axis), params), P(), P()),
        out_specs=P(axis) if split else P(),
        axis_names={axis},
        check_vma=False,
    )
    return run(params, cut(x), jax.tree.map(cut, aux)).reshape(x.shape)


def _checkpoint(remat: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``remat`` as a function wrapper: identity, ``jax.checkpoint``, or with a policy."""
    if remat is False:
        return lambda f: f
    if remat is True:
        return jax.checkpoint
    if callable(remat):
        return lambda f: jax.checkpoint(f, policy=remat)
    raise TypeError(
        "pipeline: `remat` must be a bool or a jax.checkpoint_policies policy (e.g. "
        f"jax.checkpoint_policies.dots_saveable). Received: {remat!r}."
    )


def _scan(fn: Callable[..., jax.Array], params: Any, x: jax.Array, aux: Any) -> jax.Array:
    return jax.lax.scan(lambda h, p: (fn(p, h, aux), None), x, params)[0]


def _schedule(
    chunk: Callable[[Any, jax.Array, Any], jax.Array],
    params: Any,
    xs: jax.Array,
    auxs: Any,
    stages: int,
    repeats: int,
    axis: str,
    split: bool,
) -> jax.Array:
    """One stage's part of the schedule (inside the shard_map over ``axis``).

    With ``split`` each finished microbatch travels from the last stage to the stage
    that keeps it (``m // (M / S)``) one hop per tick, in a slot that rides the same
    ring as the activations: no stage ever holds more than ``M / S`` outputs and no
    all-reduce is needed. Otherwise the last stage's outputs are all-reduced.
    """
    s = jax.lax.axis_index(axis)
    params = jax.tree.map(lambda a: a[0], params)  # this stage's [R, K, ...]
    ring = [(i, (i + 1) % stages) for i in range(stages)]
    period = stages * repeats
    microbatches = xs.shape[0]
    kept = microbatches // stages if split else microbatches

    def hop(outs: jax.Array, flying: jax.Array, tag: jax.Array) -> Any:
        """Keeps the flying output if it is this stage's, then passes the slot on."""
        here = (tag >= 0) & (tag // kept == s)
        i = jnp.clip(tag - s * kept, 0, kept - 1)
        outs = outs.at[i].set(jnp.where(here, flying, outs[i]))
        flying, tag = jax.lax.ppermute((flying, jnp.where(here, -1, tag)), axis, ring)
        return outs, flying, tag

    def tick(carry: Any, t: jax.Array) -> Any:
        incoming, outs, flying, tag = carry
        u = t - s  # this stage's place in the schedule
        g, rem = u // period, u % period
        r, j = rem // stages, rem % stages
        m = jnp.clip(g * stages + j, 0, microbatches - 1)
        valid = (u >= 0) & (g * stages + j < microbatches)
        fresh = (s == 0) & (r == 0)  # a microbatch enters the ring here
        h = jnp.where(fresh, xs[m], incoming)
        y = chunk(jax.tree.map(lambda a: a[r], params), h, jax.tree.map(lambda a: a[m], auxs))
        done = valid & (s == stages - 1) & (r == repeats - 1)
        if not split:
            outs = outs.at[m].set(jnp.where(done, y, outs[m]))
            return (jax.lax.ppermute(y, axis, ring), outs, flying, tag), None
        # A finished microbatch takes the slot: what reaches the last stage was delivered
        # on its way (no output travels past its stage), so the slot is free there.
        flying, tag = jnp.where(done, y, flying), jnp.where(done, m, tag)
        return (jax.lax.ppermute(y, axis, ring), *hop(outs, flying, tag)), None

    ticks = jnp.arange(microbatches * repeats + stages - 1)
    slot = jnp.zeros_like(xs[0]) if split else jnp.zeros((), xs.dtype)
    init = (jnp.zeros_like(xs[0]), jnp.zeros((kept, *xs.shape[1:]), xs.dtype), slot, jnp.int32(-1))
    (_, outs, flying, tag), _ = jax.lax.scan(tick, init, ticks)
    if not split:
        # Only the last stage wrote outputs; every stage returns them (the replica's result).
        return jax.lax.psum(jnp.where(s == stages - 1, outs, jnp.zeros_like(outs)), axis)

    # The last outputs still on their way: at most S - 1 more hops.
    (outs, _, _), _ = jax.lax.scan(
        lambda c, _: (hop(*c), None), (outs, flying, tag), None, length=stages - 1
    )
    return outs


def _check(
    fn: Callable[..., Any],
    stacked_params: Any,
    x: jax.Array,
    aux: Any,
    microbatches: Any,
    repeats: Any,
) -> int:
    for name, v in (("microbatches", microbatches), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TypeError(f"pipeline: `{name}` must be a positive int. Received: {v!r}.")
    leaves = jax.tree.leaves(stacked_params)
    lengths = {a.shape[0] if a.ndim else None for a in leaves}
    if not leaves or None in lengths or len(lengths) != 1:
        raise ValueError(
            "pipeline: every leaf of `stacked_params` needs the same leading (layer) "
            f"dimension. Received leading dimensions {sorted(map(str, lengths))}."
        )
    layers = int(lengths.pop() or 0)
    if not x.ndim or x.shape[0] % microbatches:
        raise ValueError(
            f"pipeline: the batch ({x.shape[0] if x.ndim else 'a scalar'} rows) must be "
            f"divisible by microbatches={microbatches}."
        )
    rows = {a.shape[0] if a.ndim else None for a in jax.tree.leaves(aux)}
    if rows - {x.shape[0]}:
        raise ValueError(
            f"pipeline: every leaf of `aux` needs the batch's {x.shape[0]} rows as its "
            f"leading dimension (it is microbatched with x). Received {sorted(map(str, rows))}."
        )

    def piece(a: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((a.shape[0] // microbatches, *a.shape[1:]), a.dtype)

    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked_params)
    mb = piece(x)
    out = jax.eval_shape(fn, one, mb, jax.tree.map(piece, aux))
    if not isinstance(out, jax.ShapeDtypeStruct) or (out.shape, out.dtype) != (mb.shape, mb.dtype):
        got = (out.shape, out.dtype) if isinstance(out, jax.ShapeDtypeStruct) else type(out)
        raise ValueError(
            f"pipeline: layer_fn must return an array of its input's shape and dtype "
            f"{(mb.shape, mb.dtype)} (a stage passes it on to the next). Received {got}."
        )
    return layers
