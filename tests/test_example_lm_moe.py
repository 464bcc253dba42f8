"""The LM example with mixture-of-experts blocks: one device equals the experts split
over an "expert" axis; checkpoints move between expert layouts; metrics; config errors."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import distrain as dt
from distrain.data import ArrayPipeline
from distrain.models import EXPERT_LAYOUT, LMConfig, count_params
from examples.lm.train import Settings, init_state, train_step

MOE = LMConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, moe_experts=4, moe_top_k=2)
SETTINGS = Settings(model=MOE, global_batch_size=16, eval_batch_size=16, optimizer="sgd")


@pytest.fixture(scope="module")
def rows():
    return {"tokens": np.random.default_rng(0).integers(0, 256, (64, 17), dtype=np.uint8)}


def model(cfg=MOE):
    apply_fn, state = init_state(dataclasses.replace(SETTINGS, model=cfg, learning_rate=0.5))
    return functools.partial(train_step, apply_fn=apply_fn), state


def fit(strategy, rows, steps=2, cfg=MOE, callbacks=()):
    step, state = model(cfg)
    trainer = dt.Trainer(strategy, step, log_every=1)
    data = ArrayPipeline(rows, global_batch_size=16, seed=0, num_epochs=None)
    state, history = trainer.fit(state, data, steps=steps, callbacks=callbacks)
    return state, history.history


def close(a, b):  # only the summation order differs
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize(
    "replicas, inner",
    [(1, {"expert": 4}), (2, {"expert": 2, "fsdp": 2})],
    ids=["1x{expert:4}", "2x{expert:2,fsdp:2}"],
)
def test_two_sgd_steps_on_an_expert_axis_equal_one_device(devices, rows, replicas, inner):
    # Each replica balances its own tokens: the load-balancing loss of two halves is not
    # the loss of the whole (it multiplies two means), so with two replicas it is off
    # here; the z-loss, a mean over tokens, is the same either way.
    cfg = MOE if replicas == 1 else dataclasses.replace(MOE, moe_balance_weight=0.0)
    one, one_history = fit(dt.MirroredStrategy(devices[:1]), rows, cfg=cfg)
    n = replicas * int(np.prod(list(inner.values())))
    strategy = dt.MirroredStrategy(devices[:n], devices_per_replica=inner, layout=EXPERT_LAYOUT)
    split, history = fit(strategy, rows, cfg=cfg)
    w_in = split.params["blocks"][0]["mlp"]["w_in"]
    assert w_in.addressable_shards[0].data.shape[0] == MOE.moe_experts // inner["expert"]
    close(jax.device_get(split.params), jax.device_get(one.params))
    assert history["loss"] == pytest.approx(one_history["loss"], rel=1e-5)
    if replicas == 1:  # statistics over the replica's tokens: one replica sees them all
        assert history["moe_balance"] == pytest.approx(one_history["moe_balance"], rel=1e-5)
    assert history["moe_dropped"] == [0.0]  # dropless (one epoch's mean)
    assert np.isfinite(history["moe_balance"]).all() and np.isfinite(history["moe_load_cv"]).all()


def test_a_checkpoint_restores_bit_for_bit_on_another_expert_layout(devices, rows, tmp_path):
    strategy = dt.MirroredStrategy(
        devices[:4], devices_per_replica={"expert": 4}, layout=EXPERT_LAYOUT
    )
    state, _ = fit(strategy, rows)
    with dt.checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        manager.save(2, state)
    for other in (
        dt.MirroredStrategy(devices[:2], devices_per_replica={"expert": 2}, layout=EXPERT_LAYOUT),
        dt.MirroredStrategy(devices[:1]),
    ):
        target = other.put_replicated(model()[1])
        restored = dt.checkpoint.CheckpointManager(tmp_path / "ckpt").restore(target=target).state
        for got, want, tmpl in zip(
            jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(target), strict=True
        ):
            assert got.sharding == tmpl.sharding  # the loader's layout
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_capacity_reports_the_dropped_share(devices, rows):
    cfg = dataclasses.replace(MOE, moe_capacity_factor=0.5)
    _, history = fit(dt.MirroredStrategy(devices[:1]), rows, cfg=cfg)
    assert all(0.0 < v < 1.0 for v in history["moe_dropped"])


def test_active_parameters_count_top_k_of_the_experts():
    dense = count_params(dataclasses.replace(MOE, moe_experts=None))
    moe = count_params(MOE)
    per_layer = 2 * MOE.d_model * MOE.ff
    router = MOE.d_model * 4
    assert moe["expert"] == MOE.n_layers * 4 * per_layer
    # Experts without biases (the dense MLP has two), a router each block.
    biases = MOE.ff + MOE.d_model
    want = dense["matmul"] + MOE.n_layers * (per_layer + router - biases)
    assert moe["matmul"] == want


@pytest.mark.parametrize(
    "change, message",
    [
        ({"moe_top_k": 5}, "moe_top_k must be an int from 1 to moe_experts \\(4\\)"),
        ({"moe_experts": 0}, "moe_experts must be a positive int"),
        ({"moe_capacity_factor": 0.0}, "moe_capacity_factor must be > 0"),
        ({"pipeline_microbatches": 2}, "cannot be pipelined yet"),
    ],
)
def test_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MOE, **change)
