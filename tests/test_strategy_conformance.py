"""One suite, every strategy x every property (optax's common-test shape).

Properties: N training steps match plain JAX on one device; the state keeps its
structure and lands where the strategy keeps state; donation frees the old state;
the Trainer (with steps_per_execution) trains the same; reduce / gather / local results
agree with the data; one compilation serves N calls; a checkpoint round-trips.
The parameter-server strategy has its own property suite (tests/test_ps.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt

STRATEGIES = {
    "default": lambda: dt.get_strategy(),
    "one_device": lambda: dt.OneDeviceStrategy("cpu:0"),
    "mirrored_1": lambda: dt.MirroredStrategy(["cpu:0"]),
    "mirrored_2": lambda: dt.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored_8": lambda: dt.MirroredStrategy(),
    "mirrored_8_packed": lambda: dt.MirroredStrategy(
        cross_device_ops=dt.HierarchicalCopyAllReduce(num_packs=2)
    ),
    "mirrored_8_to_one": lambda: dt.MirroredStrategy(cross_device_ops=dt.ReductionToOneDevice()),
    "central_storage": lambda: dt.experimental.CentralStorageStrategy(),
    "mirrored_8_sharded_state": lambda: dt.MirroredStrategy(shard_state=True, min_shard_bytes=0),
    # A replica spans k devices: FSDP over them (every leaf that divides), TP by rules.
    "replica_spans_2": lambda: dt.MirroredStrategy(devices_per_replica=2, min_shard_bytes=0),
    "replica_spans_4": lambda: dt.MirroredStrategy(devices_per_replica=4, min_shard_bytes=0),
    "replica_spans_8": lambda: dt.MirroredStrategy(devices_per_replica=8, min_shard_bytes=0),
    "tensor_parallel_4": lambda: dt.MirroredStrategy(
        devices_per_replica=4, layout={"dense/w": P(None, "model"), "out/w": P("model", None)}
    ),
    # A replica is a named mesh: 2-D layouts over FSDP x tensor axes.
    "mesh_fsdp4_tensor2": lambda: dt.MirroredStrategy(
        devices_per_replica={"fsdp": 4, "tensor": 2},
        layout={"dense/w": P(None, ("fsdp", "tensor")), "out/w": P(("fsdp", "tensor"), None)},
        min_shard_bytes=0,
    ),
    "mesh_2_replicas_fsdp2_tensor2": lambda: dt.MirroredStrategy(
        devices_per_replica={"fsdp": 2, "tensor": 2},
        layout={"dense/w": P(None, "tensor"), "out/w": P(("tensor", "fsdp"), None)},
        min_shard_bytes=0,
    ),
}

GLOBAL_BATCH = 16
TX = optax.adam(0.05)


def _data(steps: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 3))).astype(np.float32)
    return [
        {"x": x[i : i + GLOBAL_BATCH], "y": y[i : i + GLOBAL_BATCH]}
        for i in range(0, len(x), GLOBAL_BATCH)
    ]


def _init_state():
    k1, k2 = jax.random.split(jax.random.key(1))
    params = {
        "dense": {"w": jax.random.normal(k1, (5, 8)) * 0.3, "b": jnp.zeros(8)},
        "out": {"w": jax.random.normal(k2, (8, 3)) * 0.3, "b": jnp.zeros(3)},
    }
    return dt.TrainState.create(params=params, tx=TX)


def _loss(params, x, y):
    h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
    pred = h @ params["out"]["w"] + params["out"]["b"]
    return jnp.sum((pred - y) ** 2, axis=-1)


def train_step(state, batch):
    def loss_fn(p):
        return dt.compute_average_loss(
            _loss(p, batch["x"], batch["y"]), global_batch_size=GLOBAL_BATCH
        )

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _reference(steps: int):
    """Plain jax on one device: the mean loss over the whole global batch."""
    state = _init_state()
    losses = []
    for b in _data(steps):
        loss, g = jax.value_and_grad(lambda p, b=b: _loss(p, b["x"], b["y"]).mean())(state.params)
        state = state.apply_gradients(grads=g)
        losses.append(float(loss))
    return state, losses


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_training_matches_one_device(name, devices):
    strategy = STRATEGIES[name]()
    steps = 4
    ref_state, ref_losses = _reference(steps)
    with strategy.scope():
        state = strategy.put_replicated(_init_state())
        losses = []
        for batch in strategy.experimental_distribute_dataset(_data(steps)):
            state, loss = strategy.run(train_step, args=(state, batch))
            losses.append(float(strategy.reduce("sum", loss)))
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for got, want in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True
    ):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6)
    assert int(state.step) == steps


def test_one_step_on_8_replicas_moves_params_exactly_like_one_device(devices):
    """Gradients are counted once (the shard_map trap would move them 8x too far)."""
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == len(devices) == 8
    ref_state, _ = _reference(1)
    state = strategy.put_replicated(_init_state())
    batch = strategy.distribute_batch(_data(1)[0])
    state, _ = strategy.run(train_step, args=(state, batch))
    for got, want, init in zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(ref_state.params),
        jax.tree.leaves(_init_state().params),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(got) - np.asarray(init),
            np.asarray(want) - np.asarray(init),
            rtol=1e-4,
            atol=1e-7,
        )


def test_state_comes_back_replicated_and_loss_per_replica(devices):
    strategy = dt.MirroredStrategy()
    state = strategy.put_replicated(_init_state())
    batch = strategy.distribute_batch(_data(1)[0])
    state, loss = strategy.run(train_step, args=(state, batch))
    assert isinstance(loss, dt.PerReplica)
    assert len(strategy.experimental_local_results(loss)) == 8
    w = state.params["dense"]["w"]
    assert isinstance(w, jax.Array) and w.shape == (5, 8)
    assert w.sharding.is_fully_replicated


def test_central_storage_keeps_state_on_parameter_device(devices):
    strategy = dt.experimental.CentralStorageStrategy(parameter_device="cpu:3")
    state = strategy.put_replicated(_init_state())
    batch = strategy.distribute_batch(_data(1)[0])
    state, _ = strategy.run(train_step, args=(state, batch))
    assert state.params["out"]["w"].devices() == {devices[3]}
    assert strategy.num_replicas_in_sync == 8


# ------------------------------------------------------------------ properties
STRATEGY_NAMES = list(STRATEGIES)


def _placed_like_state(strategy, tree):
    for x, want in zip(
        jax.tree.leaves(tree), jax.tree.leaves(strategy.state_shardings(tree)), strict=True
    ):
        assert x.sharding.is_equivalent_to(want, x.ndim), (x.sharding, want)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_state_is_placed_where_the_strategy_keeps_it(name, devices):
    strategy = STRATEGIES[name]()
    state = strategy.put_replicated(_init_state())
    _placed_like_state(strategy, state)
    batch = strategy.distribute_batch(_data(1)[0])
    state, loss = strategy.run(train_step, args=(state, batch))
    assert jax.tree.structure(state) == jax.tree.structure(_init_state())
    _placed_like_state(strategy, state)  # results come back where state lives
    assert isinstance(loss, dt.PerReplica) or strategy.num_replicas_in_sync == 1


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_donation_frees_the_previous_state_but_not_the_callers_arrays(name, devices):
    strategy = STRATEGIES[name]()
    init = _init_state()  # JAX arrays on the default device, cpu:0, which most strategies use
    state = strategy.put_replicated(init)
    batch = strategy.distribute_batch(_data(1)[0])
    new, _ = strategy.run(train_step, args=(state, batch), donate_argnums=(0,))
    jax.block_until_ready(new)
    # put_replicated copies what it would alias: the caller's arrays survive donation,
    # also when they were placed by put_replicated already (issue 23).
    again = strategy.put_replicated(new)
    newer, _ = strategy.run(train_step, args=(again, batch), donate_argnums=(0,))
    jax.block_until_ready(newer)
    for kept, want in [(init, _init_state()), (new, None)]:
        assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
        if want is not None:
            jax.tree.map(np.testing.assert_array_equal, kept.params, want.params)
    if isinstance(strategy, dt.experimental.CentralStorageStrategy):
        return  # its state is copied to the compute devices: nothing to donate
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
    assert all(x.is_deleted() for x in jax.tree.leaves(again.params))


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_trainer_with_steps_per_execution_matches_one_device(name, devices):
    strategy = STRATEGIES[name]()
    steps = 4
    ref_state, _ = _reference(steps)
    trainer = dt.Trainer(strategy, lambda s, b: (train_step(s, b)[0], {}), steps_per_execution=2)
    state, _ = trainer.fit(_init_state(), _data(steps), steps=steps)
    for got, want in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_reduce_gather_and_local_results(name, devices):
    strategy = STRATEGIES[name]()
    n = strategy.num_replicas_in_sync
    x = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
    batch = strategy.distribute_batch({"x": x})
    np.testing.assert_array_equal(strategy.gather(batch)["x"], x)
    np.testing.assert_allclose(strategy.reduce("sum", batch, axis=0)["x"], x.sum(0))
    np.testing.assert_allclose(strategy.reduce("mean", batch, axis=0)["x"], x.mean(0))
    local = strategy.experimental_local_results(batch)
    assert len(local) == n
    np.testing.assert_array_equal(np.concatenate([r["x"] for r in local]), x)
    one = strategy.run(lambda: jnp.float32(1.0))
    assert float(strategy.reduce("sum", one)) == n  # a mirrored value counts every replica


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_one_compilation_serves_many_calls(name, devices):
    strategy = STRATEGIES[name]()
    state = strategy.put_replicated(_init_state())
    batches = list(strategy.experimental_distribute_dataset(_data(5)))
    state, _ = strategy.run(train_step, args=(state, batches[0]))
    after_first = strategy._compiler.num_programs
    for batch in batches[1:]:
        state, _ = strategy.run(train_step, args=(state, batch))
    assert after_first >= 1 and strategy._compiler.num_programs == after_first


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.split_ends  # a slow test: see tests/conftest.py
def test_checkpoint_round_trip(name, devices, tmp_path):
    strategy = STRATEGIES[name]()
    state = strategy.put_replicated(_init_state())
    batch = strategy.distribute_batch(_data(1)[0])
    state, _ = strategy.run(train_step, args=(state, batch))
    manager = dt.checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(1, state)
    manager.close()
    target = strategy.put_replicated(_init_state())
    restored = dt.checkpoint.CheckpointManager(tmp_path / "ckpt").restore(target=target).state
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding or got.sharding.is_equivalent_to(
            want.sharding, got.ndim
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
