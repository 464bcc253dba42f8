"""How :func:`distrain.nn.moe`'s tokens reach their experts' devices and come back.

One device's part of the layer under a ``shard_map`` manual over the token axes: its
tokens ``[T_d, D]`` (``T_d`` = the call's tokens over every data axis), its experts
``[E / X, ...]`` (``X``: the ``"expert"`` axis). Each pair travels within the device's
``"expert"`` group (the devices that share its other coordinates). Three exchanges:

* **padded** (dropless; the CPU path and the oracle): one ``all_to_all`` of
  ``X x T_d k`` rows each way, the most one device could receive, with the expert ids
  beside them; ``X`` times the rows that carry tokens.
* **ragged** (dropless; GPU and TPU): ``jax.lax.ragged_all_to_all`` sends each device
  only its pairs (sizes and offsets from the gathered per-expert counts,
  :func:`ragged_plan`); the receive buffer still has room for ``X x T_d k`` rows.
  XLA:CPU has no ragged all-to-all: there :func:`ragged_all_to_all_padded`, the same
  semantics over the padded collective, runs the same wiring (the tests' oracle).
* **grouped capacity** (GShard's groups, ``capacity_group="device"``): each expert takes
  at most ``C = ceil(c T_d k / E)`` of a device's pairs, so each buffer is ``E x C``
  rows (``c T_d k`` for ``c``: not ``X`` times the pairs) and the experts run as one
  batched matmul; the pairs past ``C`` are dropped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from distrain._src.nn.moe_routing import combine, kept, ranks, routed_pairs, statistics

__all__ = ["expert_parallel", "ragged_all_to_all", "ragged_all_to_all_padded", "ragged_plan"]

RaggedAllToAll = Callable[..., jax.Array]


def mlp(xs: jax.Array, sizes: jax.Array, w: dict[str, jax.Array], act: Callable) -> jax.Array:
    """The experts' MLP over rows ``xs`` sorted by expert (``sizes`` rows each; rows past
    their sum come out zero)."""
    dt = xs.dtype
    h = jax.lax.ragged_dot(xs, w["w_in"].astype(dt), sizes)
    if "w_gate" in w:
        h = act(jax.lax.ragged_dot(xs, w["w_gate"].astype(dt), sizes)) * h
    else:
        h = act(h)
    return jax.lax.ragged_dot(h.astype(dt), w["w_out"].astype(dt), sizes)


def batched_mlp(xs: jax.Array, w: dict[str, jax.Array], act: Callable) -> jax.Array:
    """The experts' MLP over ``xs`` ``[E_local, rows, D]``: one batched matmul each."""
    dt = xs.dtype
    h = jnp.einsum("erd,edf->erf", xs, w["w_in"].astype(dt))
    if "w_gate" in w:
        h = act(jnp.einsum("erd,edf->erf", xs, w["w_gate"].astype(dt))) * h
    else:
        h = act(h)
    return jnp.einsum("erf,efd->erd", h.astype(dt), w["w_out"].astype(dt))


def ragged_all_to_all(*args: jax.Array, axis_name: str) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` where the program is lowered for a GPU or TPU;
    :func:`ragged_all_to_all_padded` on CPU (XLA:CPU cannot compile
    ``ragged-all-to-all``). The choice is made per platform at lowering
    (``jax.lax.platform_dependent``), not where the program is traced."""
    return jax.lax.platform_dependent(
        *args,
        cpu=functools.partial(ragged_all_to_all_padded, axis_name=axis_name),
        default=functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name),
    )


def ragged_all_to_all_padded(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s result, computed with a padded ``all_to_all``:
    block ``d`` (``operand[input_offsets[d]:][:send_sizes[d]]``) lands in device ``d``'s
    ``output`` at ``output_offsets[d]``; rows nobody writes keep ``output``'s values.

    Example:
      >>> got = ragged_all_to_all_padded(rows, jnp.zeros_like(rows), in_off, send, out_off,
      ...                                recv, axis_name="expert")   # under shard_map
    """
    devices = input_offsets.shape[0]
    n = operand.shape[0]
    i = jnp.arange(n)
    rows = jnp.clip(input_offsets[:, None] + i[None], 0, n - 1)
    valid = i[None] < send_sizes[:, None]
    blocks = jnp.where(valid.reshape(*valid.shape, *[1] * (operand.ndim - 1)), operand[rows], 0)
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block s: from device s
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # its offset here
    where = jnp.where(i[None] < recv_sizes[:, None], at[:, None] + i[None], output.shape[0])
    flat = got.reshape(devices * n, *operand.shape[1:])
    return output.at[where.reshape(-1)].set(flat.astype(output.dtype), mode="drop")


def ragged_plan(counts: jax.Array, me: jax.Array) -> dict[str, jax.Array]:
    """The sizes and offsets of the dropless ragged exchange on device ``me`` of the
    ``"expert"`` axis, from ``counts`` ``[X, E]`` (pairs each device of the axis sends to
    each expert; the experts of device ``d`` are ``d E/X ... (d+1) E/X - 1``).

    Returns int32 ``[X]`` arrays: ``send_sizes``/``input_offsets`` (my pairs, sorted by
    expert, for each device), ``output_offsets`` (where they land there: after the
    devices before me), ``recv_sizes``/``recv_offsets`` (what each device sends me and
    where it lands here), ``back_offsets`` (where my results land in each sender's rows);
    and ``here`` ``[X, E/X]``: the rows each sender sends me for each of my experts.
    """
    x = counts.shape[0]
    local_e = counts.shape[1] // x
    blocks = counts.reshape(x, x, local_e)  # [sender, receiver, local expert]
    per = blocks.sum(-1).astype(jnp.int32)  # [sender, receiver]
    at_receiver = jnp.cumsum(per, 0) - per  # where sender s's block starts at receiver d
    at_sender = jnp.cumsum(per, 1) - per  # where the block for d starts in sender s's rows
    return {
        "send_sizes": per[me],
        "input_offsets": at_sender[me],
        "output_offsets": at_receiver[me],
        "recv_sizes": per[:, me],
        "recv_offsets": at_receiver[:, me],
        "back_offsets": at_sender[:, me],
        "here": jax.lax.dynamic_index_in_dim(blocks, me, 1, keepdims=False).astype(jnp.int32),
    }


def _ragged(x: Any, pairs: Any, w: Any, act: Callable, axis: str) -> Any:
    """The dropless exchange with ragged all-to-alls; the results in the pairs' order."""
    experts, tokens, sizes = pairs
    n = experts.shape[0]
    plan = ragged_plan(jax.lax.all_gather(sizes, axis), jax.lax.axis_index(axis))
    x_count, local_e = plan["here"].shape
    room = x_count * n  # the most one device can receive
    got = ragged_all_to_all(
        x[tokens],
        jnp.zeros((room, x.shape[-1]), x.dtype),
        plan["input_offsets"],
        plan["send_sizes"],
        plan["output_offsets"],
        plan["recv_sizes"],
        axis_name=axis,
    )
    # What arrived, sender by sender, each sorted by my experts: its expert ids.
    seg = plan["here"].reshape(-1)
    which = jnp.searchsorted(jnp.cumsum(seg), jnp.arange(room), side="right")
    ids = jnp.where(which < seg.shape[0], which % local_e, local_e)
    by_expert = jnp.argsort(ids, stable=True)
    out = mlp(got[by_expert], plan["here"].sum(0), w, act)
    out = jnp.zeros_like(out).at[by_expert].set(out)
    return ragged_all_to_all(
        out,
        jnp.zeros((n, x.shape[-1]), out.dtype),
        plan["recv_offsets"],
        plan["recv_sizes"],
        plan["back_offsets"],
        plan["send_sizes"],
        axis_name=axis,
    )


def _padded(x: Any, pairs: Any, w: Any, act: Callable, axis: str, devices: int) -> Any:
    """The dropless exchange with padded all-to-alls; the results in the pairs' order."""
    experts, tokens, sizes = pairs
    n = experts.shape[0]
    local_e = sizes.shape[0] // devices
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
    out = mlp(got[by_expert], here, w, act)
    out = jnp.zeros_like(out).at[by_expert].set(out).reshape(devices, n, -1)
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # block d: what d computed
    return back[dest, slot]


def _grouped(
    x: Any, pairs: Any, keep: Any, w: Any, act: Callable, axis: str, devices: int, cap: int
) -> Any:
    """The exchange with each expert's ``cap`` rows per device (GShard's groups): one
    ``[E x cap]``-row buffer each way; dropped pairs get zeros."""
    experts, tokens, sizes = pairs
    e, d = sizes.shape[0], x.shape[-1]
    local_e = e // devices
    slot = jnp.where(keep, experts * cap + ranks(experts, sizes), e * cap)  # past the end: none
    send = jnp.zeros((e * cap, d), x.dtype).at[slot].set(x[tokens], mode="drop")
    got = jax.lax.all_to_all(send.reshape(devices, local_e * cap, d), axis, 0, 0, tiled=True)
    mine = got.reshape(devices, local_e, cap, d).transpose(1, 0, 2, 3)
    out = batched_mlp(mine.reshape(local_e, devices * cap, d), w, act)
    out = out.reshape(local_e, devices, cap, d).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(out.reshape(devices, local_e * cap, d), axis, 0, 0, tiled=True)
    return jnp.take(back.reshape(e * cap, d), slot, axis=0, mode="fill", fill_value=0)


def expert_parallel(
    x: jax.Array,
    router: jax.Array,
    w: dict[str, jax.Array],
    bias: jax.Array | None,
    opts: dict[str, Any],
    axis: str,
    axes: tuple[str, ...],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One device's part (module docstring): ``x`` its tokens, ``w`` its experts, ``axes``
    the token axes in the call's token order (``axis`` among them).

    ``opts``: ``route_kw``, ``capacity`` (rows per expert or None), ``group`` ("call" or
    "device"), ``exchange`` ("auto", "padded" or "ragged"), ``act``, ``sizes`` (the
    mesh's axis sizes).
    """
    route_kw, capacity, act = opts["route_kw"], opts["capacity"], opts["act"]
    devices = opts["sizes"][axis]
    experts, weights, tokens, sizes, scores, z = routed_pairs(x, router, bias, route_kw)
    pairs = (experts, tokens, sizes)
    if opts["group"] == "device" and capacity is not None:
        keep = kept(experts, sizes, jnp.zeros_like(sizes), capacity)
        ys = _grouped(x, pairs, keep, w, act, axis, devices, capacity)
    else:
        every = jax.lax.all_gather(sizes, axes)  # [devices, E]: in the call's token order
        before = jnp.cumsum(every, 0)[jax.lax.axis_index(axes)] - sizes
        keep = kept(experts, sizes, before, capacity)
        ragged = functools.partial(_ragged, pairs=pairs, w=w, act=act, axis=axis)
        padded = functools.partial(_padded, pairs=pairs, w=w, act=act, axis=axis, devices=devices)
        if opts["exchange"] == "auto":  # by the platform the program is lowered for
            ys = jax.lax.platform_dependent(x, cpu=padded, default=ragged)
        else:
            ys = (ragged if opts["exchange"] == "ragged" else padded)(x)
    y = combine(x, ys, weights * keep, tokens)
    total = lambda v: jax.lax.psum(v, axes)  # noqa: E731
    stats = statistics(
        total(sizes),
        total(jnp.sum(scores, 0)),
        total(z),
        total(jnp.sum(~keep)),
        x.shape[0] * math.prod(opts["sizes"][a] for a in axes),
        route_kw["top_k"],
    )
    return y, stats
