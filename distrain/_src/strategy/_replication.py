"""Which outputs of a replica function are identical on every replica.

``strategy.run`` traces the replica function once to a jaxpr and propagates a
"varies across replicas" flag through it: inputs split across replicas and
``axis_index`` vary; the results of all-reduce-like collectives (``psum``, ``pmax``,
``pmin``, ``all_gather``) over the replica axis without ``axis_index_groups`` do not;
any other operation varies if one of its operands does (a collective over groups or
over other axes included: it is identical everywhere only if its operands are).
Outputs that do not vary come back as ordinary replicated arrays (one copy of the new
parameters), the others as per-replica values.

The analysis is exact for the control-flow primitives (``scan``, ``while``, ``cond``,
nested ``jit``, ``custom_jvp/vjp``, ``remat``), also when JAX wraps them as
``vjp_node[...]`` (jax >= 0.12, in the linear programs of ``jax.vjp``). Mutable refs
(``jax.new_ref``) are modelled soundly and coarsely: all refs of one program share a
flag, set once a value that may vary is written into any of them (or a loop with a
varying trip count, or a branch on a varying predicate, touches them).

It never crashes on what it does not know: a primitive it cannot read (a new
collective, a callback, a parameter layout of a JAX release it was not written for)
makes its outputs "varying", with one warning naming the primitive. So it can only
ever return *more* per-replica values than needed, never merge values that differ.

Private equation parameters differ between JAX releases (``scan`` has
``num_consts``/``num_carry`` up to jax 0.10 and a ``ft_in`` flat tree from 0.11);
:func:`_scan_layout` reads both and checks the result against the body's arity. A
jaxpr is read through what both releases offer, ``invars``/``constvars``/``outvars``/
``eqns`` (jax 0.10's ``ClosedJaxpr`` forwards them, jax 0.12 merged it into ``Jaxpr``),
never the legacy ``ClosedJaxpr.jaxpr`` accessor.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from jax.extend import core
from jax.ref import AbstractRef

# All replicas hold the same result after these collectives (over the replica axis,
# without `axis_index_groups`).
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
# move data between replicas (_MOVING, when over the replica axis; over an inner axis
# each replica moves its own data alike), and host callbacks (they run once per device
# and may return anything).
_MOVING = frozenset(
    {"ppermute", "pshuffle", "all_to_all", "ragged_all_to_all", "psum_scatter", "reduce_scatter"}
)
_VARYING = _MOVING | frozenset(
    {
        "axis_index",
        "io_callback",
        "pure_callback",
        "rng_uniform",
    }
)
# Collective-looking primitives that keep values as they are (type casts of the
# "varying manual axes" system): outputs vary exactly when inputs do.
_IDENTITY = frozenset({"pvary", "pcast"})
# Primitives that run their sub-program once on exactly their operands: their outputs
# are the sub-program's. (A loop-like primitive must not be read this way.)
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "xla_metadata_call",
        "compute_on",
    }
)
_CALL_JAXPR_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Ref primitives that only read.
_REF_READS = frozenset({"get", "freeze"})
# Parameters that name mesh axes: an unknown primitive carrying one may be a collective.
_AXIS_PARAMS = ("axis_name", "axes", "axis_names")

_warned: set[str] = set()


def varying_outputs(jaxpr: Any, in_varying: Sequence[bool], axis: str) -> list[bool]:
    """For each output of ``jaxpr``, whether it may differ across replicas.

    Args:
      jaxpr: the replica function's program (``jax.make_jaxpr``'s result).
      in_varying: for each input, whether it differs across replicas.
      axis: the replica axis name; collectives over other axes do not make values equal.
    """
    return _Analysis(axis).flow(jaxpr, list(in_varying))[0]


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
        stacklevel=3,
    )


def _is_ref(v: Any) -> bool:
    return isinstance(getattr(v, "aval", None), AbstractRef)


def _base(prim: Any) -> Any:
    """The primitive a ``vjp_node[...]`` wrapper (jax >= 0.12) stands for; same params."""
    while prim.name.startswith("vjp_node[") and isinstance(
        getattr(prim, "prim", None), core.Primitive
    ):
        prim = prim.prim
    return prim


def _axis_names(params: dict) -> set[Any]:
    names: set[Any] = set()
    for k in _AXIS_PARAMS:
        v = params.get(k)
        names.update(v if isinstance(v, tuple | list | frozenset) else [v])
    return names


def _names_axes(value: Any) -> bool:
    """Whether a parameter names mesh axes (strings), not array dimensions (ints)."""
    if isinstance(value, str):
        return True
    return isinstance(value, tuple | list | frozenset) and any(isinstance(v, str) for v in value)


def _arity(j: Any) -> tuple[int, int]:
    return len(j.invars), len(j.outvars)


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
    body_in, body_out = _arity(p["jaxpr"])
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    if not (nc + ncarry <= n_in == body_in and ncarry <= n_out == body_out):
        raise _Unknown(
            f"counts num_consts={nc}, num_carry={ncarry} do not fit {n_in} inputs and "
            f"{n_out} outputs"
        )
    return nc, ncarry


def _while_layout(eqn: Any) -> tuple[int, int]:
    """``(cond_nconsts, body_nconsts)`` of a ``while`` equation, checked against its bodies."""
    p = eqn.params
    try:
        cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
        cond, body = _arity(p["cond_jaxpr"]), _arity(p["body_jaxpr"])
    except (KeyError, TypeError, AttributeError) as e:
        raise _Unknown(f"unknown parameter layout {sorted(p)}: {type(e).__name__}") from None
    n_carry = len(eqn.invars) - cn - bn
    if not (n_carry >= 0 and cond == (cn + n_carry, 1) and body == (bn + n_carry, n_carry)):
        raise _Unknown(
            f"counts cond_nconsts={cn}, body_nconsts={bn} do not fit {len(eqn.invars)} "
            f"inputs, a condition taking {cond[0]} and a body taking {body[0]}"
        )
    if len(eqn.outvars) != n_carry:
        raise _Unknown(f"{len(eqn.outvars)} outputs for a carry of {n_carry}")
    return cn, bn


def _cond_branches(eqn: Any) -> Sequence[Any]:
    """The branches of a ``cond`` equation, checked against its operands and outputs."""
    p = eqn.params
    branches = p.get("branches")
    try:
        arities = [_arity(b) for b in branches]
    except (TypeError, AttributeError) as e:
        raise _Unknown(f"unknown parameter layout {sorted(p)}: {type(e).__name__}") from None
    expected = (len(eqn.invars) - 1, len(eqn.outvars))
    if not arities or any(a != expected for a in arities):
        raise _Unknown(f"branches taking/returning {arities} do not fit {expected}")
    return branches


def _or_varying(read: Any, v: Any) -> bool:
    try:
        return read(v)
    except _Unknown:
        return True


class _Analysis:
    """The flag propagation for one replica axis."""

    def __init__(self, axis: str) -> None:
        self.axis = axis

    def flow(self, jaxpr: Any, ins: list[bool]) -> tuple[list[bool], bool]:
        """Output flags of ``jaxpr``, and whether a ref it can reach may now vary.

        All refs of one program share one flag: reads from any of them vary once a value
        that may vary is written into any (aliasing views of one ref included).
        """
        refs = any(f for v, f in zip(jaxpr.invars, ins, strict=True) if _is_ref(v))
        while True:  # until the refs' flag is stable (it only ever turns on)
            env: dict[Any, bool] = dict.fromkeys(jaxpr.constvars, False)  # trace constants
            env.update(zip(jaxpr.invars, ins, strict=True))

            def read(v: Any, refs: bool = refs, env: dict = env) -> bool:
                if isinstance(v, core.Literal):
                    return False
                if _is_ref(v):
                    return refs
                if v not in env:
                    raise _Unknown("it reads a variable its program does not define")
                return env[v]

            tainted = refs
            for eqn in jaxpr.eqns:
                name = _base(eqn.primitive).name
                e_ins: list[bool] = []
                try:
                    e_ins = [read(v) for v in eqn.invars]
                    outs, taint = self.rule(eqn, name, e_ins)
                except _Unknown as e:
                    _warn_once(name, str(e))
                    outs, taint = [True] * len(eqn.outvars), True
                except (LookupError, TypeError, ValueError, AttributeError) as e:
                    _warn_once(name, f"unreadable parameters: {type(e).__name__}: {e}")
                    outs, taint = [True] * len(eqn.outvars), True
                if taint is None:  # a primitive: it may write any operand into a ref
                    taint = any(e_ins) and name not in _REF_READS
                if any(map(_is_ref, (*eqn.invars, *eqn.outvars))) and (
                    taint or any(o for v, o in zip(eqn.outvars, outs, strict=True) if _is_ref(v))
                ):
                    tainted = True
                env.update(zip(eqn.outvars, outs, strict=True))
            if tainted == refs:
                return [_or_varying(read, v) for v in jaxpr.outvars], refs
            refs = True

    def fixpoint(
        self, body: Any, consts: list[bool], carry: list[bool], rest: list[bool]
    ) -> tuple[list[bool], list[bool], bool]:
        """Iterates a loop body until the carry flags stop changing: (carry, outputs, taint)."""
        taint = False
        while True:
            out, t = self.flow(body, consts + carry + rest)
            taint = taint or t
            new = [a or b for a, b in zip(carry, out[: len(carry)], strict=True)]
            if new == carry:
                return carry, out, taint
            carry = new

    def rule(self, eqn: Any, name: str, ins: list[bool]) -> tuple[list[bool], bool | None]:
        """Output flags of one equation, and whether it may write varying values to refs.

        The second is ``None`` for a primitive without sub-programs: :meth:`flow` then
        assumes it may write any of its operands.
        """
        n_out = len(eqn.outvars)
        p = eqn.params
        if name in _SYNCING:
            # Over groups (equal-sized) or other axes, identical operands still give
            # identical results; varying ones do not.
            synced = self.axis in _axis_names(p) and p.get("axis_index_groups") is None
            return [False if synced else any(ins)] * n_out, None
        if name in _MOVING and self.axis not in _axis_names(p):
            # Data moved between the devices of each replica (a sequence split over
            # "context"): every replica does the same with its own operands.
            return [any(ins)] * n_out, None
        if name in _VARYING:
            return [True] * n_out, None
        if name == "shard_map":  # nested, manual over inner axes (a dt.nn op)
            manual = p.get("newly_manual_axes", p.get("manual_axes"))
            body = p.get("jaxpr")
            if manual is not None and self.axis not in manual and body is not None:
                if _arity(body) == (len(ins), n_out):
                    return self.flow(body, ins)
        if name in _IDENTITY and n_out == len(ins):
            return list(ins), None
        if name == "scan":
            nc, ncarry = _scan_layout(eqn)
            carry, out, taint = self.fixpoint(
                p["jaxpr"], ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
            )
            return carry + out[ncarry:], taint
        if name == "while":
            cn, bn = _while_layout(eqn)
            cond_consts, body_consts, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
            carry, _, taint = self.fixpoint(p["body_jaxpr"], body_consts, carry, [])
            (stop,), cond_taint = self.flow(p["cond_jaxpr"], cond_consts + carry)
            if stop:  # replicas may run different trip counts
                return [True] * n_out, True
            return carry, taint or cond_taint
        if name == "cond":
            branches = _cond_branches(eqn)
            if ins[0]:  # replicas may take different branches
                return [True] * n_out, True
            flows = [self.flow(b, ins[1:]) for b in branches]
            outs = [any(col) for col in zip(*(o for o, _ in flows), strict=True)]
            return outs, any(t for _, t in flows)
        if name in _CALLS:
            for key in _CALL_JAXPR_KEYS:
                sub = p.get(key)
                if sub is not None and _arity(sub) == (len(ins), n_out):
                    return self.flow(sub, ins)
        if any(_names_axes(p.get(k)) for k in _AXIS_PARAMS):
            raise _Unknown("it names mesh axes, so it may be a collective")
        if any(_makes_values_differ(j) for j in core.jaxprs_in_params(p)):
            raise _Unknown("its sub-program reads the replica id, calls the host or moves data")
        # An ordinary operation (scatter-add's combiner, a sort's comparator, a loop JAX
        # adds later included): a deterministic function of its operands.
        return [any(ins)] * n_out, None


def collectives_over(jaxpr: Any, axis: str) -> set[str]:
    """The names of the primitives in ``jaxpr`` (and its sub-programs) that name ``axis``."""
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        if axis in _axis_names(eqn.params):
            found.add(_base(eqn.primitive).name)
        for j in core.jaxprs_in_params(eqn.params):
            found |= collectives_over(j, axis)
    return found


def _makes_values_differ(jaxpr: Any) -> bool:
    """Whether a sub-program may produce per-replica values from identical inputs."""
    for eqn in jaxpr.eqns:
        name = _base(eqn.primitive).name
        if name in _VARYING or (
            name not in _SYNCING and any(_names_axes(eqn.params.get(k)) for k in _AXIS_PARAMS)
        ):
            return True
        if any(_makes_values_differ(j) for j in core.jaxprs_in_params(eqn.params)):
            return True
    return False
