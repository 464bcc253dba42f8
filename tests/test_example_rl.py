"""Smoke tests of examples/rl: the JAX CartPole and PPO under MirroredStrategy on 8 replicas."""

import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/ is not a package

import distrain as dt  # noqa: E402
from examples.rl import cartpole  # noqa: E402
from examples.rl import train as rl  # noqa: E402


def _reference_step(s, action):
    """Gymnasium CartPole-v1 (euler), written independently in NumPy."""
    x, x_dot, theta, theta_dot = s
    force = 10.0 if action == 1 else -10.0
    cos, sin = math.cos(theta), math.sin(theta)
    temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    return np.array(
        [
            x + 0.02 * x_dot,
            x_dot + 0.02 * x_acc,
            theta + 0.02 * theta_dot,
            theta_dot + 0.02 * theta_acc,
        ]
    )


def test_cartpole_follows_gymnasium_dynamics():
    state, obs = cartpole.reset(jax.random.key(3))
    ref = np.asarray(obs, np.float64)
    step = jax.jit(cartpole.step)
    actions = [1, 1, 0, 1, 0, 0, 0, 1, 1, 1]
    for i, a in enumerate(actions):
        state, obs, reward, done, _ = step(state, jnp.int32(a), jax.random.key(i))
        ref = _reference_step(ref, a)
        assert not bool(done)
        assert float(reward) == 1.0
        np.testing.assert_allclose(np.asarray(obs), ref, rtol=1e-4, atol=1e-5)
    assert int(state.t) == len(actions)
    assert float(state.episode_return) == len(actions)


def test_cartpole_terminates_when_the_pole_falls_and_resets():
    state = cartpole.EnvState(
        physics=jnp.array([0.0, 0.0, 0.2, 2.0]), t=jnp.int32(7), episode_return=jnp.float32(7.0)
    )
    step = jax.jit(cartpole.step)
    state, obs, reward, done, info = step(state, jnp.int32(1), jax.random.key(0))
    assert bool(done) and bool(info.terminated) and not bool(info.truncated)
    assert float(info.episode_return) == 8.0  # the terminating step is rewarded too
    assert int(state.t) == 0 and float(state.episode_return) == 0.0
    assert np.all(np.abs(np.asarray(obs)) <= 0.05)  # a fresh episode's start


def test_cartpole_truncates_at_500_steps():
    state = cartpole.EnvState(
        physics=jnp.zeros(4), t=jnp.int32(499), episode_return=jnp.float32(499.0)
    )
    state, _, _, done, info = jax.jit(cartpole.step)(state, jnp.int32(0), jax.random.key(0))
    assert bool(done) and bool(info.truncated) and not bool(info.terminated)
    assert float(info.episode_return) == 500.0
    assert int(state.t) == 0


def test_config_rejects_envs_not_divisible_by_replicas():
    with pytest.raises(ValueError, match=r"num_envs \(12\) must be divisible .* replicas \(8\)"):
        rl.PPOConfig(num_envs=12).validate(8)


def test_config_rejects_minibatches_not_dividing_the_replica_batch():
    cfg = rl.PPOConfig(num_envs=8, rollout_steps=6, minibatches=4)
    with pytest.raises(ValueError, match=r"batch .* = 6\) must be divisible by minibatches \(4\)"):
        cfg.validate(8)


# Three iterations of 16 envs x 16 steps; both tests below share one compiled step.
TINY = rl.PPOConfig(
    num_envs=16, rollout_steps=16, minibatches=2, epochs=2, hidden=16, total_env_steps=3 * 256
)


@pytest.fixture(scope="module")
def strategy(devices):
    return dt.MirroredStrategy()


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_one_iteration_is_distributed(strategy):
    assert strategy.num_replicas_in_sync == 8
    graphdef, state = rl.init_state(TINY)
    step = rl.make_step(graphdef, TINY)
    with strategy.scope():
        state0 = strategy.put_replicated(state)
        runner = rl.distribute_runner(rl.init_runner(TINY), 8)
        state1, runner1, metrics = strategy.run(step, args=(state0, runner))

    # Parameters come back as one replicated copy: gradients were all-reduced.
    leaf = jax.tree.leaves(state1.params)[0]
    assert isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated
    assert int(state1.step) == TINY.epochs * TINY.minibatches
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state0.params, state1.params)
    assert max(jax.tree.leaves(moved)) > 0

    # Environments stay split: each replica stepped its own 2 of the 16.
    obs = runner1.obs
    assert isinstance(obs, dt.PerReplica) and obs.num_replicas == 8
    local = strategy.experimental_local_results(runner1)
    assert len(local) == 8 and local[0].obs.shape == (2, cartpole.OBS_SIZE)
    assert not np.allclose(np.asarray(local[0].obs), np.asarray(local[1].obs))
    t = np.concatenate([np.asarray(r.env.t) for r in local])
    assert t.max() < cartpole.MAX_STEPS

    # A random policy drops the pole in ~20 steps: episodes ended and were reset.
    assert float(metrics["episodes"]) > 0
    mean_return = float(metrics["return_sum"]) / float(metrics["episodes"])
    assert 1.0 <= mean_return <= 500.0
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_train_runs_on_8_replicas(strategy):
    result = rl.train(TINY, strategy, eval_episodes=8)
    assert result.num_replicas == 8
    assert len(result.history) == 3 and result.env_steps == 3 * 256
    for row in result.history:
        assert all(np.isfinite(v) for k, v in row.items() if k != "return_smoothed")
        assert 0 <= row["return_sum"] / max(row["episodes"], 1) <= 500
    assert 0 < result.eval_return <= 500 and 0 < result.eval_return_greedy <= 500


def test_time_limit_bootstrap_adds_the_value_of_the_final_state(devices):
    graphdef, state = rl.init_state(TINY)
    env = cartpole.EnvState(
        physics=jnp.zeros((2, 4)), t=jnp.array([499, 3], jnp.int32), episode_return=jnp.zeros(2)
    )
    runner = rl.Runner(env, env.physics)
    key = jax.random.key(0)
    _, plain, _ = rl.rollout(graphdef, state.params, runner, key, 1)
    _, boot, _ = rl.rollout(graphdef, state.params, runner, key, 1, bootstrap_gamma=0.9)
    assert bool(plain.done[0, 0]) and not bool(plain.done[0, 1])
    assert float(plain.reward[0, 0]) == 1.0 and float(boot.reward[0, 1]) == 1.0
    assert float(boot.reward[0, 0]) != 1.0  # 1 + 0.9 * V(final state) for the truncated env


@pytest.mark.one_end("newest")  # a slow test: see tests/conftest.py
def test_a3c_runs_asynchronously_on_a_parameter_server(devices):
    from examples.rl import a3c

    cfg = a3c.A3CConfig(
        num_workers=2, envs_per_worker=4, rollout_steps=8, hidden=16, total_env_steps=6 * 32
    )
    result = a3c.train_a3c(cfg, eval_episodes=0)
    assert len(result.history) == 6 and result.env_steps == 6 * 32
    for row in result.history:
        assert np.isfinite(row["loss"])
        assert 0 <= row["return_sum"] / max(row["episodes"], 1) <= 500
    (server,) = result.server_stats
    assert server["applied"] == 6  # every worker gradient reached the server
    _, init = rl.init_state(rl.PPOConfig(hidden=16))
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), init.params, result.params
    )
    assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.one_end("lowest")  # a slow test: see tests/conftest.py
def test_replicas_that_span_two_devices_train_as_one_device_replicas(devices):
    """PPO's step (rollouts with lax.scan, epochs of minibatches) unchanged on 4 replicas
    of 2 devices each equals 4 replicas of one device each. The final evaluation runs
    on the host's parameters whatever the strategy: only the first run evaluates (this
    end's check of it; test_train_runs_on_8_replicas checks it on the other)."""
    results = [
        rl.train(TINY, strategy, eval_episodes=episodes)
        for strategy, episodes in (
            (dt.MirroredStrategy(devices[:4]), 8),
            (dt.MirroredStrategy(devices_per_replica=2, min_shard_bytes=0), 0),
        )
    ]
    assert 0 < results[0].eval_return <= 500 and 0 < results[0].eval_return_greedy <= 500
    assert results[1].num_replicas == 4
    params = [jax.tree.leaves(r.params) for r in results]
    for a, b in zip(*params, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    episodes = [[row["episodes"] for row in r.history] for r in results]
    assert episodes[0] == episodes[1]
