"""The replica analysis (which outputs are identical on every replica), on every JAX layout.

jax 0.10 writes a ``scan`` equation with ``num_consts``/``num_carry``; jax 0.11+ with a
``ft_in`` flat tree ``(consts, carry, xs)``. Each test environment installs one of them,
so the other layout is built by rewriting a real equation's parameters the way that
release binds them: same body, same operands, the counts moved between the two forms.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core

import distrain as dt
from distrain._src.strategy import _replication as R

AXIS = "replica"
LAYOUTS = ["jax-0.10", "jax-0.11"]


def _native_layout() -> str:
    """The scan layout the running JAX writes (the version-blind tests corrupt it too)."""
    scan = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=1))
    return "jax-0.11" if "ft_in" in scan(1.0).eqns[0].params else "jax-0.10"


def _jaxpr(fn, *args, axes=((AXIS, 4),)):
    return jax.make_jaxpr(fn, axis_env=list(axes))(*args)


def _flags(jaxpr, in_varying):
    return R.varying_outputs(jaxpr, in_varying, AXIS)


def _with_eqns(jaxpr, eqns):
    """``jaxpr`` with other equations (jax 0.12 merged ``ClosedJaxpr`` into ``Jaxpr``)."""
    if core.ClosedJaxpr is core.Jaxpr:
        return jaxpr.replace(eqns=eqns)
    return jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(eqns=eqns))


def _map_eqns(jaxpr, name, params):
    """Replaces the parameters of the equations of primitive ``name``: ``params(eqn)``."""
    eqns = [e.replace(params=params(e)) if e.primitive.name == name else e for e in jaxpr.eqns]
    assert eqns != list(jaxpr.eqns), f"no `{name}` equation"
    return _with_eqns(jaxpr, eqns)


def _scan_fn(w, b, x):
    """A scan whose carry mixes a replicated and a per-replica input."""

    def body(carry, xi):
        same, mixed = carry
        return (same * w, mixed + xi * b), same + xi

    (same, mixed), ys = jax.lax.scan(body, (w, w), x)
    return same, mixed, ys


class _FlatTree:
    """The part of jax 0.11's ``jax._src.flattree.FlatTree`` the analysis reads."""

    def __init__(self, *parts: int) -> None:
        self.parts = [list(range(n)) for n in parts]

    def unpack(self):
        return tuple(self.parts)


def _scan_params(e, layout, num_consts=None, num_carry=None):
    """The parameters of scan equation ``e`` in ``layout`` (counts overridable)."""
    p = dict(e.params)
    if "ft_in" in p:
        consts, carry, _ = p.pop("ft_in").unpack()
        nc, ncarry = len(consts), len(carry)
        p.pop("ft_out")
    else:
        nc, ncarry = p.pop("num_consts"), p.pop("num_carry")
        p.pop("linear", None)
    nc = nc if num_consts is None else num_consts
    ncarry = ncarry if num_carry is None else num_carry
    n_in, n_out = len(e.invars), len(e.outvars)
    if layout == "jax-0.10":
        return {**p, "num_consts": nc, "num_carry": ncarry, "linear": (False,) * n_in}
    return {
        **p,
        "ft_in": _FlatTree(nc, ncarry, n_in - nc - ncarry),
        "ft_out": _FlatTree(ncarry, n_out - ncarry),
    }


def _scan_jaxpr(layout):
    jaxpr = _jaxpr(_scan_fn, jnp.float32(2.0), jnp.float32(3.0), jnp.ones(5))
    if layout != _native_layout():
        jaxpr = _map_eqns(jaxpr, "scan", lambda e: _scan_params(e, layout))
    key = "num_consts" if layout == "jax-0.10" else "ft_in"
    assert key in next(e for e in jaxpr.eqns if e.primitive.name == "scan").params
    return jaxpr


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scan_flags_are_exact_in_both_layouts(layout):
    jaxpr = _scan_jaxpr(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact answer, no fallback warning
        # x varies across replicas, w and b do not.
        assert _flags(jaxpr, [False, False, True]) == [False, True, True]
        assert _flags(jaxpr, [False, False, False]) == [False, False, False]
        # b varying: only the carry that multiplies by it varies.
        assert _flags(jaxpr, [False, True, False]) == [False, True, False]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_scan_layout_it_cannot_read_falls_back_to_varying_and_warns_once(monkeypatch, layout):
    monkeypatch.setattr(R, "_warned", set())
    gone = ("num_consts", "num_carry") if layout == "jax-0.10" else ("ft_in",)
    jaxpr = _map_eqns(
        _scan_jaxpr(layout),
        "scan",
        lambda e: {
            **{k: v for k, v in e.params.items() if k not in gone},
            "layout_of_the_future": 1,
        },
    )
    with pytest.warns(RuntimeWarning, match="`scan`.*unknown parameter layout"):
        assert _flags(jaxpr, [False, False, False]) == [True, True, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per primitive, not per call
        _flags(jaxpr, [False, False, False])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_counts_that_do_not_fit_the_body_are_refused(monkeypatch, layout):
    monkeypatch.setattr(R, "_warned", set())
    jaxpr = _map_eqns(_scan_jaxpr(layout), "scan", lambda e: _scan_params(e, layout, num_carry=99))
    with pytest.warns(RuntimeWarning, match="num_carry=99 do not fit"):
        assert _flags(jaxpr, [False, False, False]) == [True, True, True]


def _loops(w, x):
    _, i = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * w), (0, w))
    c = jax.lax.cond(w > 0, lambda: w + 1, lambda: w - 1)
    return i, c, x + 1


@pytest.mark.parametrize(
    "name, corrupt, match",
    [
        ("while", lambda p: {**p, "cond_nconsts": 5}, "cond_nconsts=5.*do not fit"),
        ("while", lambda p: {k: v for k, v in p.items() if k != "body_jaxpr"}, "layout"),
        ("cond", lambda p: {**p, "branches": p["branches"][:1] * 0}, "do not fit"),
        ("cond", lambda p: {k: v for k, v in p.items() if k != "branches"}, "layout"),
    ],
)
def test_while_and_cond_layouts_it_cannot_read_fall_back_to_varying(
    monkeypatch, name, corrupt, match
):
    monkeypatch.setattr(R, "_warned", set())
    jaxpr = _jaxpr(_loops, jnp.float32(2.0), jnp.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _flags(jaxpr, [False, True]) == [False, False, True]
    jaxpr = _map_eqns(jaxpr, name, lambda e: corrupt(e.params))
    with pytest.warns(RuntimeWarning, match=f"`{name}`.*{match}"):
        out = _flags(jaxpr, [False, True])
    assert out[2] and out[:2] == ([True, False] if name == "while" else [False, True])


def _unknown_collective():
    prim = core.Primitive("brand_new_collective")
    prim.def_abstract_eval(lambda x, **_: x)
    return prim


def test_an_unknown_primitive_naming_mesh_axes_is_varying(monkeypatch):
    monkeypatch.setattr(R, "_warned", set())
    prim = _unknown_collective()
    jaxpr = _jaxpr(lambda x: prim.bind(x, axis_name=AXIS) * 2, jnp.ones(3))
    with pytest.warns(RuntimeWarning, match="brand_new_collective.*names mesh axes"):
        assert _flags(jaxpr, [False]) == [True]


def test_dimension_parameters_are_not_mistaken_for_axes():
    # reduce_sum carries `axes=(0,)`: array dimensions, an ordinary operation.
    jaxpr = _jaxpr(lambda x: jnp.sum(x, 0), jnp.ones((3, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _flags(jaxpr, [False]) == [False]
        assert _flags(jaxpr, [True]) == [True]


def test_collectives_and_callbacks():
    def f(x):
        ident = jax.lax.axis_index(AXIS)
        cb = jax.pure_callback(lambda: np.float32(1), jax.ShapeDtypeStruct((), jnp.float32))
        return jax.lax.psum(x, AXIS), x + 1, ident, cb

    assert _flags(_jaxpr(f, jnp.ones(3)), [True]) == [False, True, True, True]


def test_collectives_within_groups_or_over_other_axes_keep_values_that_vary():
    groups = [[0, 1], [2, 3]]

    def f(x):
        return (
            jax.lax.psum(x, AXIS, axis_index_groups=groups),
            jax.lax.pmax(x, AXIS, axis_index_groups=groups),
            jax.lax.all_gather(x, AXIS, axis_index_groups=groups),
            jax.lax.psum(x, "other"),  # sums over the other axis only
            jax.lax.psum(x, (AXIS, "other")),
        )

    # strategy.run binds only the replica axis, so a collective over another axis is
    # built here with a second axis in the tracing environment.
    jaxpr = _jaxpr(f, jnp.ones(3), axes=((AXIS, 4), ("other", 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _flags(jaxpr, [True]) == [True, True, True, True, False]
        # identical operands give identical results in every group
        assert _flags(jaxpr, [False]) == [False] * 5


def test_scan_inside_run_returns_replicated_state_and_per_replica_ys():
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8

    def fn(w, batch):
        def body(c, xi):
            return c * w, jnp.sum(xi)

        c, ys = jax.lax.scan(body, w, batch)
        return c, ys

    batch = strategy.distribute_batch(np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3))
    c, ys = strategy.run(fn, args=(jnp.float32(2.0), batch))
    assert not isinstance(c, dt.PerReplica) and float(c) == 8.0
    assert isinstance(ys, dt.PerReplica)
    per = strategy.experimental_local_results(ys)
    np.testing.assert_allclose(np.asarray(per[1]), [6 + 7 + 8, 9 + 10 + 11])  # rows 2, 3


def _per_replica(strategy, value):
    assert isinstance(value, dt.PerReplica), f"merged into one copy: {value}"
    return np.stack([np.asarray(v) for v in strategy.experimental_local_results(value)])


def test_a_psum_within_groups_comes_back_per_replica():
    strategy = dt.MirroredStrategy()
    x = strategy.distribute_batch(np.arange(8, dtype=np.float32))

    def fn(x):
        halves = [[0, 1, 2, 3], [4, 5, 6, 7]]
        return jax.lax.psum(x, strategy.axis_name, axis_index_groups=halves), jax.lax.psum(
            x, strategy.axis_name
        )

    grouped, total = strategy.run(fn, args=(x,))
    np.testing.assert_array_equal(_per_replica(strategy, grouped).ravel(), [6] * 4 + [22] * 4)
    assert not isinstance(total, dt.PerReplica) and float(total[0]) == 28


def test_values_written_to_refs_come_back_per_replica():
    strategy = dt.MirroredStrategy()
    x = strategy.distribute_batch(np.arange(8, dtype=np.float32))

    def fn(x, w):
        mine, looped = jax.new_ref(jnp.zeros(())), jax.new_ref(w)
        mine[...] = jnp.sum(x)  # a per-replica value

        def body(i, c):
            looped[...] += c  # written inside a loop whose trip count differs
            return c

        jax.lax.fori_loop(0, jnp.sum(x).astype(jnp.int32), body, w)
        return mine[...], looped[...]

    mine, looped = strategy.run(fn, args=(x, jnp.float32(1.0)))
    np.testing.assert_array_equal(_per_replica(strategy, mine), np.arange(8))
    np.testing.assert_array_equal(_per_replica(strategy, looped), 1 + np.arange(8))

    def same(x, w):
        r = jax.new_ref(w)
        r[...] = r[...] * 2 + jax.lax.psum(x, strategy.axis_name)[0]
        return r[...]

    out = strategy.run(same, args=(x, jnp.float32(1.0)))
    assert not isinstance(out, dt.PerReplica) and float(out) == 2.0 + 28


def test_a_ref_written_in_a_sub_program_taints_the_reads_outside():
    def f(w, x):
        r = jax.new_ref(w)
        v = r[...]  # read before the write: the same ref, so it may vary too
        jax.lax.cond(w > 0, lambda: r.__setitem__(..., x), lambda: None)
        return v, r[...], w * 2

    jaxpr = _jaxpr(f, jnp.float32(1.0), jnp.float32(2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _flags(jaxpr, [False, True]) == [True, True, False]
        assert _flags(jaxpr, [False, False]) == [False, False, False]


def _swap_carry(w, v):
    """A scan whose carries swap each step: a replicated carry varies from step 2."""
    (a, b), _ = jax.lax.scan(lambda c, _: ((c[1], c[0]), None), (w, v), None, length=2)
    return a, b


def _vjp_program():
    """The linear program of ``jax.vjp`` through a jit, a cond and a scan."""

    def loss(w):
        y = jax.jit(jnp.tanh)(w)
        y = jax.lax.cond(jnp.sum(y) > 0, lambda y: y * 2, lambda y: y, y)
        return jnp.sum(jax.lax.scan(lambda c, _: (c * y, None), y, None, length=2)[0])

    return jax.vjp(loss, jnp.ones(3))[1].jaxpr


def test_vjp_node_wrappers_are_looked_through(monkeypatch):
    program = _vjp_program()
    wrapped = {e.primitive.name for e in program.eqns}
    if not any(name.startswith("vjp_node[") for name in wrapped):
        pytest.skip(f"jax {jax.__version__} writes no vjp_node wrappers (jax 0.12 does)")
    monkeypatch.setattr(R, "_warned", set())
    assert {"vjp_node[jit]", "vjp_node[cond]", "vjp_node[scan]"} <= wrapped
    n = len(program.invars)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read exactly, not as opaque calls
        assert _flags(program, [False] * n) == [False]
        assert _flags(program, [False] * (n - 1) + [True]) == [True]
    # A wrapped scan is still iterated to its fixpoint, not read once like a call.
    node = next(e.primitive for e in program.eqns if e.primitive.name == "vjp_node[scan]")
    plain = _jaxpr(_swap_carry, jnp.float32(1.0), jnp.float32(2.0))
    wrapped_scan = _with_eqns(
        plain,
        [
            e.replace(primitive=type(node)(e.primitive)) if e.primitive.name == "scan" else e
            for e in plain.eqns
        ],
    )
    assert "vjp_node[scan]" in str(wrapped_scan)
    assert _flags(plain, [False, True]) == [True, True]
    assert _flags(wrapped_scan, [False, True]) == [True, True]


def test_ordinary_higher_order_operations_need_no_warning():
    def f(x, idx):
        return x.at[idx].add(1.0), jnp.sort(x)  # scatter-add and sort carry sub-programs

    jaxpr = _jaxpr(f, jnp.ones(4), jnp.array([0, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _flags(jaxpr, [False, False]) == [False, False]
        assert _flags(jaxpr, [False, True]) == [True, False]


def test_an_unknown_primitive_whose_sub_program_reads_the_replica_id_is_varying(monkeypatch):
    monkeypatch.setattr(R, "_warned", set())
    inner = jax.make_jaxpr(lambda x: x + jax.lax.axis_index(AXIS), axis_env=[(AXIS, 4)])(1)
    prim = core.Primitive("opaque_call")
    prim.def_abstract_eval(lambda x, **_: x)
    jaxpr = _jaxpr(lambda x: prim.bind(x, body=inner), jnp.int32(1))
    with pytest.warns(RuntimeWarning, match="opaque_call.*reads the replica id"):
        assert _flags(jaxpr, [False]) == [True]


def test_data_moved_inside_a_replica_keeps_replicated_values_replicated():
    """A ppermute over an inner axis (dt.nn's ring attention over "context") moves each
    replica's own data alike; over the replica axis it makes values differ."""
    axes = ((AXIS, 2), ("context", 4))
    inner = _jaxpr(lambda x: jax.lax.ppermute(x, "context", [(0, 1), (1, 0)]), 1.0, axes=axes)
    across = _jaxpr(lambda x: jax.lax.ppermute(x, AXIS, [(0, 1), (1, 0)]), 1.0, axes=axes)
    assert _flags(inner, [False]) == [False] and _flags(inner, [True]) == [True]
    assert _flags(across, [False]) == [True]
