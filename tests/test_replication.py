"""The replica analysis (which outputs are identical on every replica), on every JAX layout.

jax 0.10 writes a ``scan`` equation with ``num_consts``/``num_carry``; jax 0.11+ with a
``ft_in`` flat tree ``(consts, carry, xs)`` (seen on jax 0.11.2; read from JAX's source).
Only 0.10 installs here, so the 0.11 layout is built by rewriting a real 0.10 equation's
parameters the way 0.11 binds them: same body, same operands, counts in ``ft_in``.
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


def _jaxpr(fn, *args):
    return jax.make_jaxpr(fn, axis_env=[(AXIS, 4)])(*args).jaxpr


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


def _as_jax_011(jaxpr: core.Jaxpr) -> core.Jaxpr:
    """The same program with its scan equations in jax 0.11's parameter layout."""
    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan" and "num_consts" in e.params:
            p = dict(e.params)
            nc, ncarry = p.pop("num_consts"), p.pop("num_carry")
            p.pop("linear", None)
            p["ft_in"] = _FlatTree(nc, ncarry, len(e.invars) - nc - ncarry)
            p["ft_out"] = _FlatTree(ncarry, len(e.outvars) - ncarry)
            e = e.replace(params=p)
        eqns.append(e)
    return jaxpr.replace(eqns=eqns)


@pytest.mark.parametrize("layout", ["jax-0.10", "jax-0.11"])
def test_scan_flags_are_exact_in_both_layouts(layout):
    w, b, x = jnp.float32(2.0), jnp.float32(3.0), jnp.ones(5)
    jaxpr = _jaxpr(_scan_fn, w, b, x)
    if layout == "jax-0.11":
        jaxpr = _as_jax_011(jaxpr)
        assert "num_consts" not in next(e for e in jaxpr.eqns if e.primitive.name == "scan").params
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact answer, no fallback warning
        # x varies across replicas, w and b do not.
        assert R.varying_outputs(jaxpr, [False, False, True]) == [False, True, True]
        assert R.varying_outputs(jaxpr, [False, False, False]) == [False, False, False]
        # b varying: only the carry that multiplies by it varies.
        assert R.varying_outputs(jaxpr, [False, True, False]) == [False, True, False]


def test_a_scan_layout_it_cannot_read_falls_back_to_varying_and_warns_once(monkeypatch):
    monkeypatch.setattr(R, "_warned", set())
    jaxpr = _jaxpr(_scan_fn, jnp.float32(2.0), jnp.float32(3.0), jnp.ones(5))
    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            p = {k: v for k, v in e.params.items() if k not in ("num_consts", "num_carry")}
            e = e.replace(params={**p, "layout_of_the_future": 1})
        eqns.append(e)
    jaxpr = jaxpr.replace(eqns=eqns)
    with pytest.warns(RuntimeWarning, match="`scan`.*unknown parameter layout"):
        assert R.varying_outputs(jaxpr, [False, False, False]) == [True, True, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per primitive, not per call
        R.varying_outputs(jaxpr, [False, False, False])


def test_counts_that_do_not_fit_the_body_are_refused(monkeypatch):
    monkeypatch.setattr(R, "_warned", set())
    jaxpr = _jaxpr(_scan_fn, jnp.float32(2.0), jnp.float32(3.0), jnp.ones(5))
    eqns = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            e = e.replace(params={**e.params, "num_carry": 99})
        eqns.append(e)
    with pytest.warns(RuntimeWarning, match="num_carry=99 do not fit"):
        out = R.varying_outputs(jaxpr.replace(eqns=eqns), [False, False, False])
    assert out == [True, True, True]


def _unknown_collective():
    prim = core.Primitive("brand_new_collective")
    prim.def_abstract_eval(lambda x, **_: x)
    return prim


def test_an_unknown_primitive_naming_mesh_axes_is_varying(monkeypatch):
    monkeypatch.setattr(R, "_warned", set())
    prim = _unknown_collective()
    jaxpr = _jaxpr(lambda x: prim.bind(x, axis_name=AXIS) * 2, jnp.ones(3))
    with pytest.warns(RuntimeWarning, match="brand_new_collective.*names mesh axes"):
        assert R.varying_outputs(jaxpr, [False]) == [True]


def test_dimension_parameters_are_not_mistaken_for_axes():
    # reduce_sum carries `axes=(0,)`: array dimensions, an ordinary operation.
    jaxpr = _jaxpr(lambda x: jnp.sum(x, 0), jnp.ones((3, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert R.varying_outputs(jaxpr, [False]) == [False]
        assert R.varying_outputs(jaxpr, [True]) == [True]


def test_collectives_and_callbacks():
    def f(x):
        ident = jax.lax.axis_index(AXIS)
        cb = jax.pure_callback(lambda: np.float32(1), jax.ShapeDtypeStruct((), jnp.float32))
        return jax.lax.psum(x, AXIS), x + 1, ident, cb

    assert R.varying_outputs(_jaxpr(f, jnp.ones(3)), [True]) == [False, True, True, True]


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


def test_ordinary_higher_order_operations_need_no_warning():
    def f(x, idx):
        return x.at[idx].add(1.0), jnp.sort(x)  # scatter-add and sort carry sub-programs

    jaxpr = _jaxpr(f, jnp.ones(4), jnp.array([0, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert R.varying_outputs(jaxpr, [False, False]) == [False, False]
        assert R.varying_outputs(jaxpr, [False, True]) == [True, False]


def test_an_unknown_primitive_whose_sub_program_reads_the_replica_id_is_varying(monkeypatch):
    monkeypatch.setattr(R, "_warned", set())
    inner = jax.make_jaxpr(lambda x: x + jax.lax.axis_index(AXIS), axis_env=[(AXIS, 4)])(1)
    prim = core.Primitive("opaque_call")
    prim.def_abstract_eval(lambda x, **_: x)
    jaxpr = _jaxpr(lambda x: prim.bind(x, body=inner), jnp.int32(1))
    with pytest.warns(RuntimeWarning, match="opaque_call.*reads the replica id"):
        assert R.varying_outputs(jaxpr, [False]) == [True]
