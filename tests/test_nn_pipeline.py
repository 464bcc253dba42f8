"""dt.nn.pipeline: GPipe over a "stage" axis of the replica mesh equals a plain scan
over the layers (values and gradients), through strategy.run and training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain.nn import pipeline

L, D, B = 8, 16, 32


def stacked(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 2)
    return {
        "w": (jax.random.normal(k[0], (L, D, D)) * 0.3).astype(dtype),
        "b": (jax.random.normal(k[1], (L, D)) * 0.1).astype(dtype),
    }


def batch(dtype=jnp.float32):
    return jax.random.normal(jax.random.key(1), (B, D)).astype(dtype)


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def unpipelined(p, x):
    for i in range(L):
        x = layer({k: v[i] for k, v in p.items()}, x)
    return x


def loss(p, x, **kw):
    return (pipeline(layer, p, x, **kw).astype(jnp.float32) ** 2).mean()


def test_without_a_stage_axis_it_is_a_scan_over_the_layers():
    np.testing.assert_allclose(
        pipeline(layer, stacked(), batch(), microbatches=4),
        unpipelined(stacked(), batch()),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "mesh, microbatches, repeats, remat",
    [
        ({"stage": 4}, 4, 1, False),
        ({"stage": 4}, 8, 1, True),
        ({"stage": 4}, 8, 2, False),
        ({"stage": 2}, 2, 2, True),
        ({"stage": 2, "fsdp": 2}, 4, 1, jax.checkpoint_policies.dots_saveable),
        ({"stage": 4}, 2, 1, False),  # fewer microbatches than stages: outputs all-reduced
    ],
)
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_values_and_gradients_equal_the_unpipelined_layers(
    devices, mesh, microbatches, repeats, remat
):
    strategy = dt.MirroredStrategy(devices_per_replica=mesh)
    kw = dict(microbatches=microbatches, repeats=repeats, remat=remat)
    got_v, got_g = strategy.run(
        lambda p, x: jax.value_and_grad(loss)(p, x, **kw), args=(stacked(), batch())
    )
    want_v, want_g = jax.value_and_grad(lambda p, x: (unpipelined(p, x) ** 2).mean())(
        stacked(), batch()
    )
    first = strategy.experimental_local_results
    np.testing.assert_allclose(first(got_v)[0], want_v, rtol=1e-5)
    for name in ("w", "b"):
        g = got_g[name]
        g = first(g)[0] if isinstance(g, dt.PerReplica) else g
        np.testing.assert_allclose(g, want_g[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("microbatches, all_reduces", [(8, 0), (4, 0), (2, 1), (6, 1)])
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_outputs_stay_split_over_the_stages_when_the_microbatches_divide(
    devices, microbatches, all_reduces
):
    """Stage o keeps microbatches o M/S .. (o + 1) M/S - 1: no all-reduce of the output
    (S zero-padded copies of it) unless M is not a multiple of S."""
    strategy = dt.MirroredStrategy(devices[:4], devices_per_replica={"stage": 4})
    rows = 48  # divisible by every M above
    x = jax.random.normal(jax.random.key(1), (rows, D))
    args = (strategy.put_replicated(stacked()), x)
    forward = lambda p, x: pipeline(layer, p, x, microbatches=microbatches)  # noqa: E731
    hlo = strategy.compile(forward, args).as_text()
    assert hlo.count("all-reduce(") == all_reduces
    got = strategy.experimental_local_results(strategy.run(forward, args=args))[0]
    np.testing.assert_allclose(got, unpipelined(stacked(), x), rtol=1e-5, atol=1e-6)


def gated(p, h, aux):
    """A layer that reads per-row values (as a transformer reads segment ids)."""
    return jnp.tanh(h @ p["w"] + p["b"] * aux["scale"][:, None]) * aux["keep"]


def aux_rows():
    scale = jnp.linspace(0.5, 1.5, B)
    keep = (jnp.arange(B) % 3 != 0).astype(jnp.float32)[:, None]
    return {"scale": scale, "keep": keep}


def test_per_row_aux_is_microbatched_with_the_batch(devices):
    """Every row's aux values reach the layers with that row: the circular schedule with
    4 stages gives the unpipelined values and gradients (aux as well)."""

    def loss_aux(p, x, aux, **kw):
        return (pipeline(gated, p, x, aux=aux, **kw) ** 2).mean()

    def want_loss(p, x, aux):
        for i in range(L):
            x = gated({k: v[i] for k, v in p.items()}, x, aux)
        return (x**2).mean()

    strategy = dt.MirroredStrategy(devices_per_replica={"stage": 4})
    kw = dict(microbatches=8, repeats=2)
    got_v, got_g = strategy.run(
        lambda p, x, a: jax.value_and_grad(loss_aux, argnums=(0, 2))(p, x, a, **kw),
        args=(stacked(), batch(), aux_rows()),
    )
    want_v, want_g = jax.value_and_grad(want_loss, argnums=(0, 2))(stacked(), batch(), aux_rows())
    first = strategy.experimental_local_results
    np.testing.assert_allclose(first(got_v)[0], want_v, rtol=1e-5)
    is_per_replica = lambda x: isinstance(x, dt.PerReplica)  # noqa: E731
    got_g = jax.tree.map(
        lambda g: first(g)[0] if is_per_replica(g) else g, got_g, is_leaf=is_per_replica
    )
    for got, want in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Without a stage axis: a scan over the layers, aux whole.
    plain = pipeline(gated, stacked(), batch(), microbatches=4, aux=aux_rows())
    np.testing.assert_allclose((plain**2).mean(), want_v, rtol=1e-6)
    with pytest.raises(ValueError, match=r"leaf of `aux` needs the batch's 32 rows.*\['16'\]"):
        pipeline(gated, stacked(), batch(), microbatches=4, aux={"scale": jnp.ones(16)})


def test_bfloat16(devices):
    strategy = dt.MirroredStrategy(devices_per_replica={"stage": 4})
    got = strategy.run(
        lambda p, x: pipeline(layer, p, x, microbatches=4),
        args=(stacked(jnp.bfloat16), batch(jnp.bfloat16)),
    )
    got = strategy.experimental_local_results(got)[0] if isinstance(got, dt.PerReplica) else got
    want = unpipelined(stacked(jnp.bfloat16), batch(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_two_replicas_of_four_stages_train_as_the_unpipelined_model(devices):
    """Stage parameters split over "stage" (1/4 per device), 3 Adam steps."""

    def train(strategy, **kw):
        def step(state, x):
            def loss_fn(p):
                y = pipeline(layer, p, x, **kw) if kw else unpipelined(p, x)
                return dt.compute_average_loss((y**2).mean(-1))

            value, g = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=g), value

        with strategy.scope():
            state = strategy.put_replicated(
                dt.TrainState.create(params=stacked(), tx=optax.adam(1e-2))
            )
            report = strategy.memory_report(state.params)
            x = strategy.distribute_batch(batch())
            for _ in range(3):
                state, _ = strategy.run(step, args=(state, x))
        return jax.device_get(state.params), report

    want, full = train(dt.MirroredStrategy())
    staged = dt.MirroredStrategy(devices_per_replica={"stage": 4}, layout={"w|b": P("stage")})
    got, report = train(staged, microbatches=4)
    assert report["bytes_per_device"] <= 1.2 / 4 * full["bytes_per_device"]
    for name in ("w", "b"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_errors(devices):
    strategy = dt.MirroredStrategy(devices_per_replica={"stage": 4})
    with pytest.raises(ValueError, match=r"8 layers do not split into 4 stages x 3 repeats"):
        strategy.run(
            lambda p, x: pipeline(layer, p, x, microbatches=4, repeats=3), args=(stacked(), batch())
        )
    with pytest.raises(
        ValueError, match=r"microbatches \(6\) must be a multiple of the stages \(4\)"
    ):
        strategy.run(
            lambda p, x: pipeline(layer, p, x[:30], microbatches=6, repeats=2),
            args=(stacked(), batch()),
        )
    with pytest.raises(ValueError, match=r"batch \(32 rows\) must be divisible by microbatches=5"):
        pipeline(layer, stacked(), batch(), microbatches=5)
    with pytest.raises(ValueError, match=r"return an array of its input's shape and dtype"):
        pipeline(lambda p, h: h[:, :4], stacked(), batch(), microbatches=4)
    with pytest.raises(ValueError, match=r"input's shape and dtype .*bfloat16"):
        pipeline(lambda p, h: h.astype(jnp.bfloat16), stacked(), batch(), microbatches=4)
    with pytest.raises(ValueError, match=r"same leading \(layer\) dimension"):
        pipeline(layer, {"w": stacked()["w"], "b": stacked()["b"][:4]}, batch(), microbatches=4)
    for bad in (0, 2.0, True):
        with pytest.raises(TypeError, match=r"`microbatches` must be a positive int"):
            pipeline(layer, stacked(), batch(), microbatches=bad)
    for bad in (None, "dots_saveable", 1):
        with pytest.raises(TypeError, match=r"`remat` must be a bool or a jax.checkpoint_pol"):
            pipeline(layer, stacked(), batch(), microbatches=4, remat=bad)
