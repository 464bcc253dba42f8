"""Frozen parameters (``dt.TrainState.create(trainable=...)``, issue 54 section 1): no
optimizer state, no gradient all-reduce, unchanged by training, a train step written for
full training unchanged, exact checkpoints, and every wrong input refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from benchmarks.islands import collectives


def _params():
    k = jax.random.split(jax.random.key(0), 2)
    return {
        "encoder": {"w": jax.random.normal(k[0], (16, 32)) * 0.3, "b": jnp.zeros(32)},
        "head": {"w": jax.random.normal(k[1], (32, 4)) * 0.3, "b": jnp.zeros(4)},
    }


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["encoder"]["w"] + params["encoder"]["b"])
    logits = h @ params["head"]["w"] + params["head"]["b"]
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return dt.compute_average_loss(per_row, global_batch_size=64)


def train_step(state, batch):  # written for full training: nothing about freezing here
    loss, grads = state.value_and_grad(_loss)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _batch(i):
    k = jax.random.key(100 + i)
    return {"x": jax.random.normal(k, (64, 16)), "y": jax.random.randint(k, (64,), 0, 4)}


def _train(strategy, state, steps=3, step=train_step):
    state = strategy.put_replicated(state)
    for i in range(steps):
        state, _ = strategy.run(step, args=(state, strategy.distribute_batch(_batch(i))))
    return jax.device_get(state)


def test_frozen_leaves_have_no_optimizer_state_and_do_not_move(devices):
    strategy = dt.MirroredStrategy()
    frozen = dt.TrainState.create(params=_params(), tx=optax.adam(1e-2), trainable="head")
    # adam: its count, and mu and nu of the head's two leaves only (absent, not zeros).
    assert len(jax.tree.leaves(frozen.opt_state)) == 1 + 2 * 2
    after = _train(strategy, frozen)
    before = _params()
    for name in ("w", "b"):
        np.testing.assert_array_equal(after.params["encoder"][name], before["encoder"][name])
    assert not np.array_equal(after.params["head"]["w"], before["head"]["w"])
    # The head trains exactly as under optax's own masking of the same optimizer.
    labels = {"encoder": {"w": "f", "b": "f"}, "head": {"w": "t", "b": "t"}}
    tx = optax.multi_transform({"t": optax.adam(1e-2), "f": optax.set_to_zero()}, labels)
    reference = _train(strategy, dt.TrainState.create(params=_params(), tx=tx))
    for name in ("w", "b"):
        np.testing.assert_allclose(
            after.params["head"][name], reference.params["head"][name], rtol=1e-6, atol=1e-7
        )


def _all_reduced_bytes(strategy, state):
    hlo = strategy.compile(train_step, (state, _batch(0))).as_text()
    return sum(c.bytes for c in collectives(hlo, island_of=lambda d: d) if c.op == "all-reduce")


def test_only_the_trainable_gradients_are_all_reduced(devices):
    """The compiled step's all-reduces carry the head's gradients (and the loss), not
    the encoder's: the frozen gradients never leave their device."""
    strategy = dt.MirroredStrategy()
    full = dt.TrainState.create(params=_params(), tx=optax.sgd(0.1))
    frozen = dt.TrainState.create(params=_params(), tx=optax.sgd(0.1), trainable="head")
    head = sum(x.nbytes for x in jax.tree.leaves(_params()["head"]))
    everything = sum(x.nbytes for x in jax.tree.leaves(_params()))
    full_bytes, frozen_bytes = (
        _all_reduced_bytes(strategy, full),
        _all_reduced_bytes(strategy, frozen),
    )
    assert everything <= full_bytes < everything + 64  # + the loss
    assert head <= frozen_bytes < head + 64


def test_a_tree_of_bools_and_frozen_parameters_in_bfloat16(devices):
    mask = {"encoder": {"w": False, "b": False}, "head": {"w": True, "b": True}}
    state = dt.TrainState.create(
        params=_params(), tx=optax.sgd(0.1), trainable=mask, frozen_dtype="bfloat16"
    )
    assert state.params["encoder"]["w"].dtype == jnp.bfloat16
    assert state.params["head"]["w"].dtype == jnp.float32
    after = _train(dt.MirroredStrategy(), state, steps=2)
    assert after.params["encoder"]["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(after.params["encoder"]["w"], state.params["encoder"]["w"])
    assert np.isfinite(np.asarray(after.params["head"]["w"])).all()


def test_gradient_accumulation_keeps_only_the_trainable_gradients(devices):
    strategy = dt.MirroredStrategy()
    state = dt.TrainState.create(params=_params(), tx=optax.sgd(0.1), trainable="head")
    step = dt.accumulate_gradients(train_step, 2)
    once = _train(strategy, state, steps=1)
    twice = _train(strategy, state, steps=1, step=step)  # the same update in two halves
    np.testing.assert_allclose(twice.params["head"]["w"], once.params["head"]["w"], atol=1e-6)
    np.testing.assert_array_equal(twice.params["encoder"]["w"], state.params["encoder"]["w"])


def test_a_checkpoint_restores_a_frozen_state_exactly(tmp_path, devices):
    strategy = dt.MirroredStrategy()
    state = dt.TrainState.create(params=_params(), tx=optax.adam(1e-2), trainable="head")
    trained = _train(strategy, state, steps=2)
    with dt.checkpoint.CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(2, trained)
        restored = manager.restore(target=strategy.put_replicated(state)).state
    assert restored.trainable == state.trainable
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)
    # Going on from the restored state equals going on from the one in memory.
    a, b = _train(strategy, restored, steps=1), _train(strategy, trained, steps=1)
    np.testing.assert_array_equal(a.params["head"]["w"], b.params["head"]["w"])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"trainable": "lora"}, ValueError, r"trainable='lora'\) matches no parameter.*encoder/b"),
        (
            {"trainable": {"encoder": {"w": False, "b": False}, "head": {"w": 0, "b": 0}}},
            ValueError,
            "marks no parameter trainable",
        ),
        ({"trainable": {"encoder": True}}, ValueError, "a pytree of bools with params' structure"),
        ({"trainible": "head"}, TypeError, "got the keyword 'trainible': did you mean 'trainable'"),
    ],
    ids=["pattern", "all false", "structure", "misspelt"],
)
def test_wrong_trainable_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        dt.TrainState.create(params=_params(), tx=optax.sgd(0.1), **kwargs)


def test_extra_collections_still_pass_as_keywords():
    state = dt.TrainState.create(params=_params(), tx=optax.sgd(0.1), batch_stats={"m": 1.0})
    assert state.extra == {"batch_stats": {"m": 1.0}} and state.trainable is None
