"""``shard_state=True``: 1/N of the state per device, the same training as replicated.

The conformance suite (tests/test_strategy_conformance.py) pins "same parameters as
one device after N steps" for ``mirrored_8_sharded_state``; here: the layout and its
memory, the Trainer, checkpoints moved between layouts and device counts, and 2
processes x 4 devices against 1 x 8.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain._src.cluster.launch import free_port
from tests.linear_problem import new_state, problem, train_step
from tests.processes import run_together
from tests.test_multi_worker import clean_env

SCRIPT = str(Path(__file__).parent / "scripts" / "mw_sharded.py")


def big_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (64, 256)) * 0.05,  # 64 KiB: sharded
        "w2": jax.random.normal(k2, (256, 8)) * 0.05,  # 8 KiB: below the threshold
        "b1": jnp.zeros(256),
    }
    return dt.TrainState.create(params=params, tx=optax.adam(1e-3))


def test_large_leaves_are_split_and_memory_drops_to_about_one_nth(devices):
    sharded = dt.MirroredStrategy(shard_state=True)
    mirrored = dt.MirroredStrategy()
    s_state = sharded.put_replicated(big_state())
    m_state = mirrored.put_replicated(big_state())
    w1 = s_state.params["w1"]
    assert w1.sharding.spec == jax.sharding.PartitionSpec(None, "replica")  # largest dim
    assert w1.addressable_shards[0].data.shape == (64, 32)
    assert s_state.params["w2"].sharding.is_fully_replicated  # small
    assert s_state.opt_state[0].mu["w1"].sharding.spec == w1.sharding.spec  # moments too
    s, m = sharded.memory_report(s_state), mirrored.memory_report(m_state)
    assert s["bytes_full_copy"] == m["bytes_full_copy"] == m["bytes_per_device"]
    # w1 and its two Adam moments (3 x 64 KiB) are split 8 ways; the rest is replicated.
    small = m["bytes_per_device"] - 3 * 64 * 256 * 4
    assert s["bytes_per_device"] == small + 3 * 64 * 256 * 4 // 8
    assert s["bytes_per_device"] < m["bytes_per_device"] / 3
    assert s["sharded_leaves"] == 3


def test_the_state_stays_sharded_through_steps_and_matches_mirrored(devices):
    def step(state, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
            return dt.compute_average_loss(jnp.sum((h @ p["w2"]) ** 2, -1))

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params)), {}

    x = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
    results = {}
    for name, strategy in [
        ("sharded", dt.MirroredStrategy(shard_state=True)),
        ("mirrored", dt.MirroredStrategy()),
    ]:
        state = strategy.put_replicated(big_state())
        batch = strategy.distribute_batch({"x": x})
        for _ in range(3):
            state, _ = strategy.run(step, args=(state, batch), donate_argnums=(0,))
        results[name] = state
    sharded = results["sharded"]
    assert not sharded.params["w1"].sharding.is_fully_replicated
    assert int(sharded.step) == 3
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(results["mirrored"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_trainer_fit_with_sharded_state_equals_mirrored(devices):
    data = dict(problem(128))
    finals = []
    for strategy in (
        dt.MirroredStrategy(shard_state=True, min_shard_bytes=0),
        dt.MirroredStrategy(),
    ):
        pipe = dt.data.ArrayPipeline(data, global_batch_size=32, num_epochs=None)
        final, history = dt.Trainer(strategy, train_step).fit(new_state(), pipe, steps=6)
        finals.append(final)
    for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("save_sharded", [True, False])
def test_checkpoints_move_between_layouts_and_device_counts(tmp_path, devices, save_sharded):
    saver = dt.MirroredStrategy(shard_state=save_sharded)
    state = saver.put_replicated(big_state())
    manager = dt.checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(1, state)
    manager.close()
    for loader in (
        dt.MirroredStrategy(shard_state=not save_sharded),  # the other layout
        dt.MirroredStrategy(devices[:4], shard_state=True),  # 8 -> 4 devices
        dt.OneDeviceStrategy("cpu:0"),
    ):
        target = loader.put_replicated(big_state())
        restored = dt.checkpoint.CheckpointManager(tmp_path / "ckpt").restore(target=target).state
        for got, want, tmpl in zip(
            jax.tree.leaves(restored),
            jax.tree.leaves(state),
            jax.tree.leaves(target),
            strict=True,
        ):
            assert got.sharding == tmpl.sharding  # the loader's layout
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def train_1x8_and_2x4(tmp_path, ref_args, worker_args):
    """Runs tests/scripts/mw_sharded.py on one process of 8 devices (``ref_args``) and on
    2 processes x 4 devices (``worker_args``); returns the reference's result and each
    process's."""
    ref = tmp_path / "ref"
    ref.mkdir()
    [(code, log, _)] = run_together(
        [([sys.executable, SCRIPT, "--out", str(ref), *ref_args], clean_env(8))], 120
    )
    assert code == 0, log
    port = free_port()
    jobs = []
    for i in range(2):
        env = clean_env(
            4,
            DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            DISTRAIN_NUM_PROCESSES="2",
            DISTRAIN_PROCESS_ID=str(i),
            DISTRAIN_TIMEOUT_SECONDS="30",
        )
        jobs.append(([sys.executable, SCRIPT, "--out", str(tmp_path), *worker_args], env))
    for code, log, _ in run_together(jobs, 120):
        assert code == 0, log
    results = []
    for name in [ref / "result_0.npz", *(tmp_path / f"result_{pid}.npz" for pid in (0, 1))]:
        with np.load(name) as f:
            results.append(dict(f))
    return results[0], results[1:]


@pytest.mark.split_ends  # a slow test: see tests/conftest.py
@pytest.mark.parametrize(
    "extra, cols",
    [
        ([], 2),
        (["--accum", "2", "--policy", "mixed_bfloat16"], 2),
        (["--shard-state", "process"], 4),
    ],
    ids=["plain", "accum_bf16", "hybrid"],
)
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path, extra, cols):
    """Sharded over all 8 devices, or (hybrid) over each process's 4 with a copy per
    process: w1's 16 columns sit 2 or 4 to a device, and training equals 1 x 8 mirrored."""
    # The reference is mirrored: its --shard-state comes last, so it wins.
    want, results = train_1x8_and_2x4(tmp_path, [*extra, "--shard-state", "0"], extra)
    for got in results:
        assert int(got["replicas"]) == int(want["replicas"]) == 8
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
        for name in ("w1", "b1", "w2", "b2"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
        assert int(got["bytes_per_device"]) < int(want["bytes_per_device"])
        assert int(got["w1_cols_per_device"]) == cols
        assert int(want["w1_cols_per_device"]) == 16
    assert want["losses"][0] != want["losses"][-1]


def test_shard_state_choices(devices):
    one_process = dt.MirroredStrategy(shard_state="process")  # all 8 devices are one process
    w1 = one_process.put_replicated(big_state()).params["w1"]
    assert w1.addressable_shards[0].data.shape == (64, 32)
    assert w1.sharding.mesh.shape == {"process": 1, "replica": 8}
    with pytest.raises(ValueError, match=r"`shard_state` must be True.*'process'.*'host'"):
        dt.MirroredStrategy(shard_state="host")
    with pytest.raises(ValueError, match=r"shard_state=1\b"):
        dt.MirroredStrategy(shard_state=1)


def test_config_takes_the_hybrid_layout():
    from distrain._src.train.config import config_from_dict
    from distrain.config import ConfigError

    code = {"model": {"fn": "m:f"}, "data": {"fn": "d:f"}, "train": {"train_step": "s:f"}}
    cfg = config_from_dict(
        {**code, "strategy": {"name": "multi_worker_mirrored", "shard_state": "process"}}
    )
    assert cfg.strategy.shard_state == "process"
    with pytest.raises(ConfigError, match=r"'strategy.shard_state' must be bool \| 'process'"):
        config_from_dict({**code, "strategy": {"shard_state": "host"}})
