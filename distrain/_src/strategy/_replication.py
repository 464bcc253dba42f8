"""Which outputs of a replica function are identical on every replica.

``strategy.run`` traces the replica function once to a jaxpr and propagates a
"varies across replicas" flag through it: inputs split across replicas and
``axis_index`` vary; the results of all-reduce-like collectives (``psum``, ``pmax``,
``pmin``, ``all_gather``) do not; any other operation varies if one of its operands
does. Outputs that do not vary come back as ordinary replicated arrays (one copy of
the new parameters), the others as per-replica values.

The analysis is exact for the control-flow primitives (``scan``, ``while``, ``cond``,
nested ``jit``, ``custom_jvp/vjp``, ``remat``) and never crashes on what it does not
know: a primitive it cannot read (a new collective, a callback, a parameter layout of
a JAX release it was not written for) makes its outputs "varying", with one warning
naming the primitive. So it can only ever return *more* per-replica values than
needed, never merge values that differ.

Private equation parameters differ between JAX releases (``scan`` has
``num_consts``/``num_carry`` up to jax 0.10 and a ``ft_in`` flat tree from 0.11);
:func:`_scan_layout` reads both and checks the result against the body's arity.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from jax.extend import core

# All replicas hold the same result after these collectives.
_SYNCING = frozenset(
    {
        "psum",
        "pmax",
        "pmin",
        "all_gather",
        "psum_invariant",
        "all_gather_invariant",
        "pbroadcast",  # a broadcast from one source replica to all
    }
)
# These produce values that differ per replica whatever their inputs: collectives that
# move data between replicas, and host callbacks (they run once per device and may
# return anything).
_VARYING = frozenset(
    {
        "axis_index",
        "ppermute",
        "pshuffle",
        "all_to_all",
        "ragged_all_to_all",
        "psum_scatter",
        "reduce_scatter",
        "io_callback",
        "pure_callback",
        "rng_uniform",
    }
)
# Collective-looking primitives that keep values as they are (type casts of the
# "varying manual axes" system): outputs vary exactly when inputs do.
_IDENTITY = frozenset({"pvary", "pcast"})
# Parameters that name mesh axes: an unknown primitive carrying one may be a collective.
_AXIS_PARAMS = ("axis_name", "axes", "axis_names")

_warned: set[str] = set()


def varying_outputs(jaxpr: core.Jaxpr, in_varying: Sequence[bool]) -> list[bool]:
    """For each output of ``jaxpr``, whether it may differ across replicas."""
    env: dict[Any, bool] = dict(zip(jaxpr.invars, in_varying, strict=True))

    def read(v: Any) -> bool:
        return False if isinstance(v, core.Literal) else env.get(v, False)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        try:
            outs = _rule(eqn, ins)
        except _Unknown as e:
            _warn_once(eqn.primitive.name, str(e))
            outs = [True] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


class _Unknown(Exception):
    """An equation the analysis cannot read; its outputs are taken as varying."""


def _warn_once(primitive: str, why: str) -> None:
    if primitive in _warned:
        return
    _warned.add(primitive)
    warnings.warn(
        f"distrain cannot tell whether the outputs of `{primitive}` are identical on every "
        f"replica ({why}); they are treated as per-replica values. Results stay correct; "
        "values derived from them come back as dt.PerReplica instead of replicated "
        "arrays. Please report the JAX version and this primitive to distrain.",
        RuntimeWarning,
        stacklevel=2,
    )


def _open(j: Any) -> core.Jaxpr:
    return j.jaxpr if isinstance(j, core.ClosedJaxpr) else j


def _fixpoint(body: core.Jaxpr, consts: list[bool], carry: list[bool], rest: list[bool]):
    """Iterates a loop body until the carry flags stop changing; returns (carry, outputs)."""
    while True:
        out = varying_outputs(body, consts + carry + rest)
        new = [a or b for a, b in zip(carry, out[: len(carry)], strict=True)]
        if new == carry:
            return carry, out
        carry = new


def _scan_layout(eqn: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation, on every supported JAX release.

    jax <= 0.10: integer params ``num_consts`` and ``num_carry``. jax >= 0.11: ``ft_in``,
    a flat tree ``(consts, carry, xs)`` whose parts' lengths are those counts.
    """
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        nc, ncarry = int(p["num_consts"]), int(p["num_carry"])
    elif "ft_in" in p:
        try:
            consts, carry, _ = p["ft_in"].unpack()
            nc, ncarry = len(consts), len(carry)
        except Exception as e:  # a layout newer than this code
            raise _Unknown(f"unreadable `ft_in` parameter: {type(e).__name__}: {e}") from None
    else:
        raise _Unknown(f"unknown parameter layout {sorted(p)}")
    body = _open(p["jaxpr"])
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    if not (nc + ncarry <= n_in == len(body.invars) and ncarry <= n_out == len(body.outvars)):
        raise _Unknown(
            f"counts num_consts={nc}, num_carry={ncarry} do not fit {n_in} inputs and "
            f"{n_out} outputs"
        )
    return nc, ncarry


def _names_axes(value: Any) -> bool:
    """Whether a parameter names mesh axes (strings), not array dimensions (ints)."""
    if isinstance(value, str):
        return True
    return isinstance(value, tuple | list | frozenset) and any(isinstance(v, str) for v in value)


def _jaxprs_in_params(params: dict) -> Any:
    find = getattr(core, "jaxprs_in_params", None)
    if find is not None:
        return find(params)
    return [v for v in params.values() if isinstance(v, core.Jaxpr | core.ClosedJaxpr)]


def _rule(eqn: Any, ins: list[bool]) -> list[bool]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in _SYNCING:
        return [False] * n_out
    if name in _VARYING:
        return [True] * n_out
    if name in _IDENTITY and n_out == len(ins):
        return list(ins)
    p = eqn.params
    if name == "scan":
        nc, ncarry = _scan_layout(eqn)
        carry, out = _fixpoint(
            _open(p["jaxpr"]), ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
        )
        return carry + out[ncarry:]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
        carry, _ = _fixpoint(_open(p["body_jaxpr"]), body_consts, carry, [])
        if varying_outputs(_open(p["cond_jaxpr"]), cond_consts + carry)[0]:
            return [True] * n_out  # replicas may run different trip counts
        return carry
    if name == "cond":
        if ins[0]:
            return [True] * n_out
        outs = [varying_outputs(_open(b), ins[1:]) for b in p["branches"]]
        return [any(col) for col in zip(*outs, strict=True)]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = p.get(key)
        if sub is not None and len(_open(sub).invars) == len(ins):
            return varying_outputs(_open(sub), ins)
    if any(_names_axes(p.get(k)) for k in _AXIS_PARAMS):
        raise _Unknown("it names mesh axes, so it may be a collective")
    if any(_makes_values_differ(_open(j)) for j in _jaxprs_in_params(p)):
        raise _Unknown("its sub-program reads the replica id, calls the host or moves data")
    # An ordinary operation (scatter-add's combiner, a sort's comparator included): a
    # deterministic function of its operands.
    return [any(ins)] * n_out


def _makes_values_differ(jaxpr: core.Jaxpr) -> bool:
    """Whether a sub-program may produce per-replica values from identical inputs."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _VARYING or (
            name not in _SYNCING and any(_names_axes(eqn.params.get(k)) for k in _AXIS_PARAMS)
        ):
            return True
        if any(_makes_values_differ(_open(j)) for j in _jaxprs_in_params(eqn.params)):
            return True
    return False
