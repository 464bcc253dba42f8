"""DiLoCo's round: when each fragment's outer step runs, over an immutable state.

The outer step itself (pseudo-gradient, outer optimizer step, merge) is
``outer_step.py``; this module counts the inner steps and runs it, or puts a fragment's
pseudo-gradient in flight, at the positions ``schedule.py`` gives.

Framework-free: nothing here reads a mesh or a strategy. The islands' parameters carry
a leading island axis; on one device that is an ordinary array axis (the reference
driver :func:`diloco_step` vmaps the inner step over it), and a strategy that shards it
over an ``"island"`` mesh axis gets the cross-island collectives from the compiler
(the mean over islands is an all-reduce; the ``gather`` hook places the quantized
payloads so that the all-gather moves their bytes, not float32).

The round (see ``schedule.py`` for the exact semantics, torchft's):

1. every island takes one inner step; ``state.step`` counts them;
2. after step ``s``, for the fragment whose snapshot position is ``s mod H`` (only with
   ``fragment_sync_delay > 0``): its pseudo-gradient, global minus the mean of the
   islands' parameters, goes "in flight" (``state.in_flight``, float32, one copy);
3. for the fragment whose sync position is ``s mod H``: the outer optimizer (its own
   state per fragment) steps the global parameters with that pseudo-gradient (taken
   now when there is no delay), and the islands merge with the new global parameters.

At most one of 2 and 3 happens after a step (``d < H / F`` keeps their positions
apart), so :func:`after_inner_step` is one ``lax.switch`` on the counter, inside the
compiled step.

"In flight" is a delayed application, not an overlap: the exchange of step 2 (the
collective over the islands, under a strategy) runs inside step ``s - d``'s program,
which ends when it is done; the next ``d`` steps compute with it finished, and step 3
applies the stored result. Streaming DiLoCo's maths (torchft's fixtures) hold; its
speed-up does not here. Hiding the exchange behind the ``d`` steps needs a collective
that starts in one step and completes in a later one, which XLA can run asynchronously
on GPU; on CPU its collectives are synchronous.

Every counter is an array leaf of :class:`DiLoCoState`: a state restored into a fresh
template resumes mid-round, with the exchange in flight, exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Self

import jax
import jax.numpy as jnp
import optax
from flax import struct

# island.py and the public `distrain.experimental.islands` import delayed_nesterov from
# here (its home is delayed_nesterov.py); the coordinator's modules import outer_update.
from distrain._src.islands.delayed_nesterov import delayed_nesterov as delayed_nesterov
from distrain._src.islands.outer_step import (
    Gather,
    Mean,
    Params,
    accum_dtype,
    merge,
    outer_update,
    pseudo_gradient,
)
from distrain._src.islands.schedule import DiLoCoConfig, fragment_ids, leaf_paths
from distrain._src.pytree import PyTree

ParamsOf = Callable[[Any], Params]
WithParams = Callable[[Any, Params], Any]


@struct.dataclass
class DiLoCoState:
    """Global parameters, outer optimizer states, the islands' states and the counters.

    Attributes:
      params: the global parameters (the last synced model; what evaluation uses).
      outer_opt_state: one outer optimizer state per fragment, a tuple: fragment ``f``'s
        is ``outer_optimizer.init`` of the parameters with the other fragments' leaves
        replaced by ``optax.MaskedNode()`` (as ``optax.masked`` does), so with one
        fragment it is the plain ``outer_optimizer.init(params)``.
      inner: the islands' states (the user's train state), every leaf with a leading
        island axis.
      step: int32, the inner steps taken; the position in the round is
        ``step % sync_every``.
      in_flight: with ``fragment_sync_delay > 0``, the mean pseudo-gradients exchanged
        and not yet applied (the parameters' structure, float32; each fragment's
        leaves are meaningful between its snapshot and its sync); ``None`` otherwise.
    """

    params: Params
    outer_opt_state: tuple[Any, ...]
    inner: Any
    step: jax.Array
    in_flight: Params | None = None

    if TYPE_CHECKING:
        # Added by @struct.dataclass at runtime; declared here so type checkers see it.
        def replace(self, **changes: Any) -> Self: ...


def params_attr(inner: Any) -> Params:
    """The default ``params_of``: ``inner.params`` (a ``TrainState``)."""
    return inner.params


def replace_params(inner: Any, params: Params) -> Any:
    """The default ``with_params``: ``inner.replace(params=params)``."""
    return inner.replace(params=params)


def _masked(treedef: Any, leaves: Sequence[Any], ids: Sequence[int], f: int) -> PyTree:
    """The parameters' structure with only fragment ``f``'s leaves (``optax.masked``'s way)."""
    kept = [x if i == f else optax.MaskedNode() for x, i in zip(leaves, ids, strict=True)]
    return jax.tree.unflatten(treedef, kept)


def _pick(leaves: Sequence[Any], ids: Sequence[int], f: int) -> list[Any]:
    return [x for x, i in zip(leaves, ids, strict=True) if i == f]


def _put(leaves: Sequence[Any], ids: Sequence[int], f: int, new: Sequence[Any]) -> list[Any]:
    it = iter(new)
    return [next(it) if i == f else x for x, i in zip(leaves, ids, strict=True)]


def init(
    config: DiLoCoConfig,
    inner: Any,
    islands: int | None = None,
    *,
    params_of: ParamsOf = params_attr,
) -> DiLoCoState:
    """The state at step 0: every island a copy of ``inner``, the global params its params.

    Args:
      config: the :class:`DiLoCoConfig`.
      inner: one island's state (e.g. a ``TrainState``); with ``islands=None``, the
        islands' states already stacked on a leading island axis (all equal).
      islands: the number of islands, or None (see ``inner``).
      params_of: where the parameters are in ``inner`` (default ``inner.params``).

    Raises:
      ValueError: ``islands < 1``; stacked states without a common leading axis; the
        fragment errors of :func:`schedule.fragment_ids`.
      TypeError: a parameter leaf that is not floating point.

    Example:
      >>> config = DiLoCoConfig(sync_every=3, outer_optimizer=optax.sgd(1.0))
      >>> state = init(config, {"w": jnp.ones(2)}, islands=4, params_of=lambda s: s)
      >>> state.inner["w"].shape, int(state.step)
      ((4, 2), 0)
    """
    if islands is None:
        sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(inner)}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                "With islands=None, `inner` must be the islands' states stacked on a "
                "leading island axis (the same length on every leaf). Received leading "
                f"dimensions {sorted(map(str, sizes))}. Pass one island's state and islands=N."
            )
        global_params = jax.tree.map(lambda x: jnp.array(x[0]), params_of(inner))
    else:
        if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1:
            raise ValueError(f"islands must be an int >= 1. Received: islands={islands!r}.")
        global_params = jax.tree.map(jnp.array, params_of(inner))
        inner = jax.tree.map(
            lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (islands, *jnp.shape(x))), inner
        )
    for path, x in zip(leaf_paths(global_params), jax.tree.leaves(global_params), strict=True):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(
                f"DiLoCo averages parameters, so they must be floating point; the leaf "
                f"{path!r} is {x.dtype}. Keep integer state outside the parameters "
                "(e.g. in TrainState.extra)."
            )
    ids = fragment_ids(config, global_params)
    leaves, treedef = jax.tree.flatten(global_params)
    opt_states = tuple(
        config.outer_optimizer.init(_masked(treedef, leaves, ids, f))
        for f in range(config.num_fragments)
    )
    in_flight = None
    if config.fragment_sync_delay:
        in_flight = jax.tree.map(lambda x: jnp.zeros(x.shape, accum_dtype(x.dtype)), global_params)
    return DiLoCoState(
        params=global_params,
        outer_opt_state=opt_states,
        inner=inner,
        step=jnp.zeros((), jnp.int32),
        in_flight=in_flight,
    )


def event_index(config: DiLoCoConfig, step: jax.typing.ArrayLike) -> jax.Array:
    """Which branch of :func:`after_inner_step` runs after ``step`` inner steps.

    0: nothing; ``1 + f``: fragment ``f`` syncs; ``1 + F + f``: fragment ``f``'s
    pseudo-gradient goes in flight (only with a delay).

    Example:
      >>> config = DiLoCoConfig(6, optax.sgd(1.0), fragments=2, fragment_sync_delay=1)
      >>> [int(event_index(config, s)) for s in range(1, 7)]
      [0, 3, 1, 0, 4, 2]
    """
    positions = list(config.sync_positions)
    if config.fragment_sync_delay:
        positions += config.snapshot_positions
    pos = jnp.asarray(step, jnp.int32) % config.sync_every
    index = jnp.zeros((), jnp.int32)
    for i, p in enumerate(positions):
        index = index + jnp.where(pos == p, jnp.int32(i + 1), jnp.int32(0))
    return index


def in_flight_fragment(config: DiLoCoConfig, step: jax.typing.ArrayLike) -> jax.Array:
    """The fragment whose exchange is in flight after ``step`` inner steps, or -1.

    Example:
      >>> config = DiLoCoConfig(6, optax.sgd(1.0), fragments=2, fragment_sync_delay=1)
      >>> [int(in_flight_fragment(config, s)) for s in range(1, 7)]
      [-1, 0, -1, -1, 1, -1]
    """
    d = config.fragment_sync_delay
    pos = jnp.asarray(step, jnp.int32) % config.sync_every
    out = jnp.full((), -1, jnp.int32)
    for f, p in enumerate(config.snapshot_positions):
        since = (pos - p) % config.sync_every
        out = jnp.where(since < d, jnp.int32(f), out)
    return out


_Carry = tuple[Params, tuple[Any, ...], Params, Params | None]


def _snapshot(
    config: DiLoCoConfig,
    ids: Sequence[int],
    f: int,
    gather: Gather | None,
    mean: Mean | None,
    carry: _Carry,
) -> _Carry:
    global_params, opt_states, local, in_flight = carry
    g = jax.tree.leaves(global_params)
    pg = pseudo_gradient(
        _pick(g, ids, f),
        _pick(jax.tree.leaves(local), ids, f),
        outer_dtype=config.outer_dtype,
        gather=gather,
        mean=mean,
    )
    flight, treedef = jax.tree.flatten(in_flight)
    return global_params, opt_states, local, jax.tree.unflatten(treedef, _put(flight, ids, f, pg))


def _sync(
    config: DiLoCoConfig,
    ids: Sequence[int],
    f: int,
    gather: Gather | None,
    mean: Mean | None,
    carry: _Carry,
) -> _Carry:
    global_params, opt_states, local, in_flight = carry
    g, treedef = jax.tree.flatten(global_params)
    local_leaves, local_def = jax.tree.flatten(local)
    if in_flight is None:
        pg = pseudo_gradient(
            _pick(g, ids, f),
            _pick(local_leaves, ids, f),
            outer_dtype=config.outer_dtype,
            gather=gather,
            mean=mean,
        )
    else:
        pg = _pick(jax.tree.leaves(in_flight), ids, f)
    new_global, new_opt = outer_update(
        config.outer_optimizer,
        _masked(treedef, g, ids, f),
        opt_states[f],
        _masked(treedef, _put(g, ids, f, pg), ids, f),
    )
    new_g = jax.tree.leaves(new_global)
    merged = merge(new_g, _pick(local_leaves, ids, f), config.fragment_update_alpha)
    return (
        jax.tree.unflatten(treedef, _put(g, ids, f, new_g)),
        (*opt_states[:f], new_opt, *opt_states[f + 1 :]),
        jax.tree.unflatten(local_def, _put(local_leaves, ids, f, merged)),
        in_flight,
    )


def _no_event(carry: _Carry) -> _Carry:
    return carry


def after_inner_step(
    config: DiLoCoConfig,
    state: DiLoCoState,
    *,
    params_of: ParamsOf = params_attr,
    with_params: WithParams = replace_params,
    gather: Gather | None = None,
    mean: Mean | None = None,
) -> DiLoCoState:
    """Counts one inner step and runs the outer logic it calls for (inside ``jit``).

    Call it with ``state.inner`` after the islands' inner step: it increments
    ``state.step`` to ``s`` and, by ``s mod H``, puts a fragment's pseudo-gradient in
    flight, or syncs a fragment (outer optimizer step on the global parameters, merge of
    the islands), or does nothing: one ``lax.switch`` on the counter.

    Args:
      config: the :class:`DiLoCoConfig`.
      state: the state whose ``inner`` has just taken step ``state.step + 1``.
      params_of: where the (island-stacked) parameters are in ``state.inner``.
      with_params: ``state.inner`` with its parameters replaced.
      gather, mean: see :func:`pseudo_gradient`.

    Returns:
      The new state.
    """
    ids = fragment_ids(config, state.params)
    branches: list[Callable[[_Carry], _Carry]] = [_no_event]
    branches += [partial(_sync, config, ids, f, gather, mean) for f in range(config.num_fragments)]
    if config.fragment_sync_delay:
        branches += [
            partial(_snapshot, config, ids, f, gather, mean) for f in range(config.num_fragments)
        ]
    step = state.step + 1
    carry = (state.params, state.outer_opt_state, params_of(state.inner), state.in_flight)
    global_params, opt_states, local, in_flight = jax.lax.switch(
        event_index(config, step), branches, carry
    )
    return state.replace(
        params=global_params,
        outer_opt_state=opt_states,
        inner=with_params(state.inner, local),
        step=step,
        in_flight=in_flight,
    )


def diloco_step(
    config: DiLoCoConfig,
    state: DiLoCoState,
    inner_update_fn: Callable[..., tuple[Any, Any]],
    *args: Any,
    params_of: ParamsOf = params_attr,
    with_params: WithParams = replace_params,
    gather: Gather | None = None,
) -> tuple[DiLoCoState, Any]:
    """The reference driver: one inner step on every island, then :func:`after_inner_step`.

    Args:
      config: the :class:`DiLoCoConfig`.
      state: the :class:`DiLoCoState`.
      inner_update_fn: ``(island_state, *island_args) -> (island_state, aux)``, one
        island's step (vmapped over the island axis).
      *args: its arguments, each with a leading island axis (e.g. each island's batch).
      params_of, with_params, gather: see :func:`after_inner_step`.

    Returns:
      The new state and ``aux`` with a leading island axis.

    Example:
      >>> config = DiLoCoConfig(sync_every=2, outer_optimizer=optax.sgd(1.0))
      >>> state = init(config, jnp.ones(()), islands=2, params_of=lambda s: s)
      >>> step = jax.jit(lambda st, g: diloco_step(config, st, lambda p, g: (p - g, None), g,
      ...                params_of=lambda s: s, with_params=lambda s, p: p))
      >>> state, _ = step(state, jnp.array([1.0, 3.0]))
      >>> state, _ = step(state, jnp.array([1.0, 3.0]))   # islands at -1, -5: global 1 - 4
      >>> state.params
      Array(-3., dtype=float32)
    """
    inner, aux = jax.vmap(inner_update_fn)(state.inner, *args)
    state = state.replace(inner=inner)
    state = after_inner_step(
        config, state, params_of=params_of, with_params=with_params, gather=gather
    )
    return state, aux
