"""The LM example with mixture-of-experts blocks: one device equals the experts split
over an "expert" axis; checkpoints move between expert layouts; metrics; the selection
bias (moe_balance="bias") is state that resumes exactly; config errors."""

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


def test_the_selection_bias_is_state_that_resumes_exactly(devices, rows, tmp_path):
    """moe_balance="bias" on 2 replicas: 4 steps straight equal 2 steps, a
    crash, a restore from the backup and 2 more, bit for bit (the bias included); the bias
    moved, by DeepSeek-V3's rule on the load averaged over the replicas (every device
    holds the same bias), and took no optimizer step (no gradient, no loss term)."""
    cfg = dataclasses.replace(MOE, moe_balance="bias", moe_bias_rate=0.05)

    def run(backup, crash_at=None):
        def crash(info):
            if crash_at is not None and info.step >= crash_at:
                raise RuntimeError("simulated crash")

        strategy = dt.MirroredStrategy(devices[:2])  # each replica routes its own rows
        backups = dt.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False)
        callbacks = [backups, dt.callbacks.LambdaCallback(on_train_batch_end=crash)]
        return fit(strategy, rows, steps=4, cfg=cfg, callbacks=callbacks)

    straight, history = run(tmp_path / "a")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "b", crash_at=2)
    resumed, _ = run(tmp_path / "b")
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for block in straight.params["blocks"].values():
        bias = block["mlp"]["selection_bias"]
        shards = [np.asarray(s.data) for s in bias.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)  # the replicas agree
        # 4 steps of +-0.05 or 0 (it oscillates at first: the rule overshoots).
        steps = np.asarray(bias) / 0.05
        assert np.allclose(steps, np.round(steps), atol=1e-4) and np.abs(steps).max() <= 4
    assert np.isfinite(history["moe_load_cv"]).all()

    # One step from zero: bias = rate * sign(mean load - load), block by block, from the
    # step's own routing; no gradient reaches it (SGD would have moved it off the grid).
    step, state = model(cfg)
    batch = {"tokens": rows["tokens"][:16]}
    load = step.keywords["apply_fn"](state.params, batch["tokens"][:, :-1], return_aux=True)[1]
    load = np.asarray(load["expert_load_by_block"])
    after, _ = jax.jit(step)(state, batch)
    for i, block in after.params["blocks"].items():
        want = 0.05 * np.sign(load[i].mean() - load[i])
        np.testing.assert_allclose(np.asarray(block["mlp"]["selection_bias"]), want, atol=1e-7)
    assert np.abs(load - load.mean(-1, keepdims=True)).max() > 0  # it had something to do


def test_scanned_blocks_equal_the_unrolled_and_keep_one_block_of_temporaries():
    """scan_layers: the same logits, statistics and gradients as the unrolled blocks
    (their parameters stacked); under remat the compiled step's temporaries grow by
    little per block (unrolled, jax 0.10.2's XLA:CPU keeps every recomputed block's
    temporaries alive: the 8x7B plan's 9 GiB a block)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from distrain.models import Transformer

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 64)))

    def build(n, scan):
        cfg = LMConfig(seq_len=64, d_model=64, n_heads=2, n_layers=n, moe_experts=4,
                       remat="nothing_saveable", scan_layers=scan)  # fmt: skip
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

        def loss(p):
            logits, aux = nnx.merge(graphdef, p)(tokens, return_aux=True)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
            return ce + aux["moe_loss"], aux

        return jax.jit(jax.value_and_grad(loss, has_aux=True)), nnx.to_pure_dict(params)

    (unrolled, params), (scanned, _) = build(3, False), build(3, True)
    stacked = dict(params, blocks=jax.tree.map(lambda *b: jnp.stack(b), *params["blocks"].values()))
    (want, want_aux), want_grads = unrolled(params)
    (got, got_aux), got_grads = scanned(stacked)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    close(got_aux, want_aux)
    want_blocks = jax.tree.map(lambda *b: jnp.stack(b), *want_grads["blocks"].values())
    close(got_grads, dict(want_grads, blocks=want_blocks))

    def temp(n, scan):
        f, p = build(n, scan)
        return f.lower(p).compile().memory_analysis().temp_size_in_bytes

    one = temp(1, False)  # one block: the same program either way
    per_block = (temp(3, True) - one) / 2
    # Each more block adds its input and its gradients' slice, not a block's
    # temporaries. (Unrolled, jax 0.10.2's XLA:CPU adds 3.4x this per block; 0.12's
    # schedules the unrolled recomputation well: not asserted, it is the compiler's.)
    assert per_block < one / 3, (per_block, one)  # 0.26 on 0.10.2


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
        ({"moe_balance": "aux"}, "moe_balance must be 'loss' .* or 'bias'"),
        ({"moe_bias_rate": 0.0}, "moe_bias_rate must be a number > 0"),
    ],
)
def test_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MOE, **change)


def test_update_expert_bias_refuses_a_load_for_other_blocks():
    """The aux of another model (a load for 3 blocks, parameters for 2) is refused in one
    line; an aux without a load (moe_balance="loss", a dense model) leaves the state."""
    import types

    from distrain.models import update_expert_bias

    bias = np.zeros(4, np.float32)
    params = {"blocks": {str(i): {"mlp": {"selection_bias": bias}} for i in range(2)}}
    state = types.SimpleNamespace(params=params, replace=lambda **kw: kw)
    aux = {
        "expert_load_by_block": np.ones((3, 4), np.float32),
        "selection_bias_by_block": np.zeros((3, 4), np.float32),
        "moe_bias_rate": 1e-3,
    }
    with pytest.raises(ValueError, match=r"load is for 3 blocks but params\['blocks'\] has 2"):
        update_expert_bias(state, aux)
    assert update_expert_bias(state, {}) is state
