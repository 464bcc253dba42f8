"""Which outputs of a replica function are identical on every replica.

``strategy.run`` traces the replica function once to a jaxpr and propagates a
"varies across replicas" flag through it: inputs split across replicas and
``axis_index`` vary; the results of all-reduce-like collectives (``psum``, ``pmax``,
``pmin``, ``all_gather``) do not; any other operation varies if one of its operands
does. Outputs that do not vary come back as ordinary replicated arrays (one copy of
the new parameters), the others as per-replica values.

The analysis is exact for the control-flow primitives (``scan``, ``while``, ``cond``,
nested ``jit``, ``custom_jvp/vjp``, ``remat``) and conservative (treats an output as
varying) for anything it does not know, so it can only ever return *more*
per-replica values than needed, never merge values that differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core

# All replicas hold the same result after these collectives.
_SYNCING = frozenset(
    {"psum", "pmax", "pmin", "all_gather", "psum_invariant", "all_gather_invariant"}
)
# These produce values that differ per replica whatever their inputs.
_VARYING = frozenset({"axis_index", "ppermute", "all_to_all", "psum_scatter", "reduce_scatter"})


def varying_outputs(jaxpr: core.Jaxpr, in_varying: Sequence[bool]) -> list[bool]:
    """For each output of ``jaxpr``, whether it may differ across replicas."""
    env: dict[Any, bool] = dict(zip(jaxpr.invars, in_varying, strict=True))

    def read(v: Any) -> bool:
        return False if isinstance(v, core.Literal) else env.get(v, False)

    for eqn in jaxpr.eqns:
        outs = _rule(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


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


def _rule(eqn: Any, ins: list[bool]) -> list[bool]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name in _SYNCING:
        return [False] * n_out
    if name in _VARYING:
        return [True] * n_out
    p = eqn.params
    if name == "scan":
        nc, ncarry = p["num_consts"], p["num_carry"]
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
    return [any(ins)] * n_out
