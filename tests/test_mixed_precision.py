"""Mixed precision: Keras' policies on a TrainState, bf16 accuracy, float16 loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain.mixed_precision import DynamicLossScale, Policy

HIDDEN = 64


def init_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (64, HIDDEN)) * 0.1,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 10)) * 0.1,
        "b2": jnp.zeros(10),
    }


def logits_fn(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return (h @ p["w2"] + p["b2"]).astype(jnp.float32)  # the last layer in float32, as Keras


def train_step(state, batch):
    def loss_fn(params, batch):
        per_example = optax.softmax_cross_entropy_with_integer_labels(
            logits_fn(params, batch["x"]), batch["y"]
        )
        return dt.compute_average_loss(per_example)

    loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}


def digits(split):
    d = dt.data.load_digits(split)
    return {"x": d["image"].reshape(-1, 64).astype(np.float32), "y": d["label"]}


def test_policy_names_and_dtypes():
    bf16 = Policy("mixed_bfloat16")
    assert (bf16.compute_dtype, bf16.param_dtype, bf16.loss_scaling) == (
        jnp.bfloat16,
        jnp.float32,
        False,
    )
    assert Policy("mixed_float16").loss_scaling
    with pytest.raises(ValueError, match="Unknown mixed-precision policy 'fp8'.*mixed_bfloat16"):
        Policy("fp8")
    with pytest.raises(TypeError, match="`policy` must be a policy name"):
        dt.TrainState.create(params=init_params(), tx=optax.sgd(0.1), policy=16)


def test_compute_runs_in_bf16_and_gradients_come_back_float32():
    state = dt.TrainState.create(params=init_params(), tx=optax.sgd(0.1), policy="mixed_bfloat16")
    batch = {"x": np.ones((4, 64), np.float32), "y": np.zeros(4, np.int32)}
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))

    def loss_fn(p, b):
        return jnp.mean(logits_fn(p, b["x"]))

    jaxpr = jax.make_jaxpr(state.value_and_grad(loss_fn))(state.params, batch)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
    assert loss.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def fit(policy, mirrored, epochs=12):
    state = dt.TrainState.create(params=init_params(), tx=optax.adam(3e-3), policy=policy)
    train = dt.data.ArrayPipeline(digits("train"), global_batch_size=64, seed=1)
    final, _ = dt.Trainer(mirrored, train_step, log_every=1000).fit(
        state, train, epochs=epochs, steps_per_epoch=train.steps_per_epoch
    )
    test = digits("test")
    pred = jnp.argmax(logits_fn(jax.device_get(final.params), test["x"]), -1)
    return float(np.mean(np.asarray(pred) == test["y"]))


def test_bf16_training_reaches_float32_accuracy_within_a_point(mirrored):
    f32 = fit(None, mirrored)
    bf16 = fit("mixed_bfloat16", mirrored)
    assert f32 > 0.9
    assert abs(bf16 - f32) <= 0.01, (f32, bf16)


def test_an_overflow_skips_exactly_one_update_and_halves_the_scale(mirrored):
    def step(state, batch):
        def loss_fn(params, batch):
            per_example = jnp.sum(logits_fn(params, batch["x"]) ** 2, -1) * batch["blow"]
            return dt.compute_average_loss(per_example)

        loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    state = mirrored.put_replicated(
        dt.TrainState.create(params=init_params(), tx=optax.sgd(0.01), policy="mixed_float16")
    )
    x = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    ok = mirrored.distribute_batch({"x": x, "blow": np.ones(16, np.float32)})
    bad = mirrored.distribute_batch({"x": x, "blow": np.full(16, 1e30, np.float32)})
    scales, params = [], []
    for batch in (ok, bad, ok):
        before = jax.device_get(state.params)
        state, _ = mirrored.run(step, args=(state, batch))
        scales.append(float(state.loss_scale.scale))
        params.append(
            not all(
                np.array_equal(a, b)
                for a, b in zip(
                    jax.tree.leaves(before),
                    jax.tree.leaves(jax.device_get(state.params)),
                    strict=True,
                )
            )
        )
    assert params == [True, False, True]  # only the overflowing step was skipped
    assert scales == [2.0**15, 2.0**14, 2.0**14]
    assert int(state.loss_scale.good_steps) == 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_the_scale_grows_after_the_growth_interval():
    scale = DynamicLossScale.create(initial_scale=8.0, growth_interval=3)
    for _ in range(3):
        scale = scale.adjust(jnp.asarray(True))
    assert float(scale.scale) == 16.0 and int(scale.good_steps) == 0
    assert float(scale.adjust(jnp.asarray(False)).scale) == 8.0


def test_resume_with_a_loss_scale_is_bit_exact(tmp_path, mirrored):
    data = digits("train")
    pipe = lambda: dt.data.ArrayPipeline(data, global_batch_size=64, seed=3)  # noqa: E731
    make = lambda: dt.TrainState.create(  # noqa: E731
        params=init_params(), tx=optax.adam(1e-3), policy="mixed_float16"
    )
    full, _ = dt.Trainer(mirrored, train_step).fit(make(), pipe(), steps=6)
    backup = dt.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=3)

    class StopAt3(dt.callbacks.Callback):
        def on_train_batch_end(self, info):
            if info.step == 3:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dt.Trainer(mirrored, train_step, callbacks=[backup, StopAt3()]).fit(make(), pipe(), steps=6)
    resumed, _ = dt.Trainer(mirrored, train_step, callbacks=[backup]).fit(make(), pipe(), steps=6)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(resumed.loss_scale.scale) == float(full.loss_scale.scale)


@pytest.fixture(scope="module")
def mirrored():
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    return strategy
