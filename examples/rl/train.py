"""PPO on CartPole with the environment inside the compiled, per-replica step.

The unit of work is one PPO *iteration*, written as a per-replica function for
``strategy.run``:

1. each replica steps its own slice of the vectorised environments for
   ``rollout_steps`` steps (``lax.scan``; the environment is :mod:`cartpole`,
   written in JAX, so the rollout never leaves the device);
2. it computes generalised advantage estimates for its slice;
3. it runs ``epochs`` x ``minibatches`` PPO updates; every minibatch gradient is
   summed over replicas by ``TrainState.apply_gradients`` (per-example losses
   are divided by the *global* minibatch size, so the sum is the gradient of
   the global mean), and advantage statistics are all-reduced too, so the
   update is the one a single device would make on the whole batch.

Parameters, optimiser state and the random key are replicated (identical on
every replica); environment states are a ``dt.PerReplica`` value that stays
split across replicas between iterations.

Example:
    >>> import distrain as dt
    >>> result = train(PPOConfig(num_envs=8, total_env_steps=8 * 16 * 2, rollout_steps=16),
    ...                dt.MirroredStrategy())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import distrain as dt

from . import cartpole

PyTree = Any


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO hyper-parameters (defaults: the tuned run in README.md)."""

    num_envs: int = 16
    """Environments stepped in parallel, across all replicas; split evenly between them."""
    rollout_steps: int = 64
    """Steps per environment in each iteration's rollout."""
    total_env_steps: int = 500_000
    """Budget: the run does ``total_env_steps // (num_envs * rollout_steps)`` iterations."""
    epochs: int = 4
    minibatches: int = 4
    """Minibatches per epoch; each replica's slice is split into this many."""
    learning_rate: float = 1e-3
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    bootstrap_time_limit: bool = True
    """Bootstrap from the value of the final state when the 500-step limit (not a
    failure) ends an episode; see :func:`rollout`."""
    seed: int = 0

    @property
    def steps_per_iteration(self) -> int:
        return self.num_envs * self.rollout_steps

    @property
    def num_iterations(self) -> int:
        return max(1, self.total_env_steps // self.steps_per_iteration)

    def validate(self, num_replicas: int) -> None:
        """Raises ValueError when the sizes cannot be split over ``num_replicas``."""
        if self.num_envs % num_replicas:
            raise ValueError(
                f"num_envs ({self.num_envs}) must be divisible by the number of replicas "
                f"({num_replicas}); choose a multiple of {num_replicas}."
            )
        local_batch = self.num_envs // num_replicas * self.rollout_steps
        if local_batch % self.minibatches:
            raise ValueError(
                f"each replica's batch (num_envs / replicas * rollout_steps = {local_batch}) must "
                f"be divisible by minibatches ({self.minibatches}); change minibatches or "
                "rollout_steps."
            )


class ActorCritic(nnx.Module):
    """Separate two-layer tanh MLPs for the policy logits and the state value."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        ortho = nnx.initializers.orthogonal
        root2 = math.sqrt(2.0)

        def dense(i: int, o: int, scale: float) -> nnx.Linear:
            return nnx.Linear(i, o, kernel_init=ortho(scale), rngs=rngs)

        self.actor = nnx.List(
            [
                dense(cartpole.OBS_SIZE, hidden, root2),
                dense(hidden, hidden, root2),
                dense(hidden, cartpole.NUM_ACTIONS, 0.01),  # near-uniform initial policy
            ]
        )
        self.critic = nnx.List(
            [
                dense(cartpole.OBS_SIZE, hidden, root2),
                dense(hidden, hidden, root2),
                dense(hidden, 1, 1.0),
            ]
        )

    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        def mlp(layers: nnx.List, x: jax.Array) -> jax.Array:
            for layer in layers[:-1]:
                x = jnp.tanh(layer(x))
            return layers[-1](x)

        return mlp(self.actor, obs), mlp(self.critic, obs)[..., 0]


class Runner(NamedTuple):
    """Per-replica environment state carried from one iteration to the next."""

    env: cartpole.EnvState
    obs: jax.Array


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array
    episode_return: jax.Array  # return of an episode that ended at this step, else 0


@functools.cache  # one object per config: the optimizer is part of the compiled step's key
def make_optimizer(cfg: PPOConfig) -> optax.GradientTransformation:
    """Adam with global-norm clipping and (optionally) a linearly annealed learning rate."""
    updates_total = cfg.num_iterations * cfg.epochs * cfg.minibatches
    lr = (
        optax.linear_schedule(cfg.learning_rate, 0.0, updates_total)
        if cfg.anneal_lr
        else cfg.learning_rate
    )
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(lr, eps=1e-5))


def init_state(cfg: PPOConfig) -> tuple[nnx.GraphDef, dt.TrainState]:
    """Builds the model and its TrainState; the graphdef rebuilds the model from params."""
    model = ActorCritic(cfg.hidden, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model)
    state = dt.TrainState.create(
        params=params, tx=make_optimizer(cfg), rng=jax.random.key(cfg.seed + 1)
    )
    return graphdef, state


def init_runner(cfg: PPOConfig) -> Runner:
    """Resets all ``cfg.num_envs`` environments (global arrays, leading axis = env)."""
    keys = jax.random.split(jax.random.key(cfg.seed + 2), cfg.num_envs)
    env, obs = cartpole.reset_batch(keys)
    return Runner(env=env, obs=obs)


def distribute_runner(runner: Runner, num_replicas: int) -> Runner:
    """Splits the environments over replicas: every leaf becomes a *stacked* ``dt.PerReplica``.

    ``strategy.run`` returns per-replica outputs that way (one row per replica, one
    ``PerReplica`` per leaf), so giving the first iteration the same layout lets
    every iteration reuse one compiled step.
    """
    return jax.tree.map(
        lambda x: dt.PerReplica(
            x.reshape(num_replicas, -1, *x.shape[1:]), num_replicas, stacked=True
        ),
        runner,
    )


def rollout(
    graphdef,
    params,
    runner: Runner,
    key: jax.Array,
    steps: int,
    bootstrap_gamma: float | None = None,
):
    """Steps the local environments ``steps`` times; returns the trajectory (time-major).

    With ``bootstrap_gamma``, an episode cut by the 500-step limit (not a failure)
    gets ``gamma * V(final state)`` added to its last reward, so that the value
    target does not treat the time limit as the end of the world.
    """
    model = nnx.merge(graphdef, params)

    def one_step(carry, step_key):
        runner = carry
        act_key, env_key = jax.random.split(step_key)
        logits, value = model(runner.obs)
        action = jax.random.categorical(act_key, logits)
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
        env_keys = jax.random.split(env_key, runner.obs.shape[0])
        env, obs, reward, done, info = cartpole.step_batch(runner.env, action, env_keys)
        if bootstrap_gamma is not None:
            _, final_value = model(info.final_obs)
            reward = reward + bootstrap_gamma * jax.lax.stop_gradient(final_value) * info.truncated
        transition = Transition(
            runner.obs, action, log_prob, value, reward, done, info.episode_return
        )
        return Runner(env, obs), transition

    runner, traj = jax.lax.scan(one_step, runner, jax.random.split(key, steps))
    _, last_value = model(runner.obs)
    return runner, traj, last_value


def gae(traj: Transition, last_value: jax.Array, gamma: float, lam: float):
    """Generalised advantage estimates; any episode end (failure or time limit) cuts them."""

    def back(carry, t):
        gae, next_value = carry
        not_done = 1.0 - t.done.astype(jnp.float32)
        delta = t.reward + gamma * next_value * not_done - t.value
        gae = delta + gamma * lam * not_done * gae
        return (gae, t.value), gae

    _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), traj, reverse=True)
    return adv, adv + traj.value


def _ppo_loss(params, graphdef, batch, cfg: PPOConfig, global_minibatch: int):
    obs, action, old_log_prob, old_value, adv, target = batch
    ctx = dt.get_replica_context()
    # Normalise advantages with statistics of the *global* minibatch, so that
    # N replicas make exactly the update one device would make.
    stats = ctx.all_reduce("sum", jnp.stack([adv.sum(), (adv**2).sum()]))
    mean = stats[0] / global_minibatch
    std = jnp.sqrt(jnp.maximum(stats[1] / global_minibatch - mean**2, 0.0))
    adv = (adv - mean) / (std + 1e-8)

    logits, value = nnx.merge(graphdef, params)(obs)
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, action[:, None], axis=-1)[:, 0]
    ratio = jnp.exp(log_prob - old_log_prob)
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    policy = -jnp.minimum(ratio * adv, clipped * adv)
    value_clipped = old_value + jnp.clip(value - old_value, -cfg.clip_eps, cfg.clip_eps)
    value_loss = 0.5 * jnp.maximum((value - target) ** 2, (value_clipped - target) ** 2)
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
    per_example = policy + cfg.value_coef * value_loss - cfg.entropy_coef * entropy
    loss = dt.compute_average_loss(per_example, global_batch_size=global_minibatch)
    parts = jnp.stack(
        [
            dt.compute_average_loss(p, global_batch_size=global_minibatch)
            for p in (policy, value_loss, entropy)
        ]
    )
    return loss, parts


def ppo_iteration(
    state: dt.TrainState, runner: Runner, *, graphdef: nnx.GraphDef, cfg: PPOConfig
) -> tuple[dt.TrainState, Runner, dict[str, jax.Array]]:
    """One PPO iteration for one replica: rollout, advantages, updates (all-reduced).

    Args:
        state: replicated TrainState (params, optimiser state, rng).
        runner: this replica's environments (its slice of the global ``Runner``).
        graphdef: the model structure, from :func:`init_state`.
        cfg: hyper-parameters.

    Returns:
        ``(state, runner, metrics)``: the new replicated state, this replica's
        environments, and metrics already summed over replicas (identical everywhere).
    """
    ctx = dt.get_replica_context()
    n = ctx.num_replicas_in_sync
    # The shared key advances identically everywhere; each replica folds in its id
    # so that its environments and action samples differ from the others'.
    shared_key, next_key = jax.random.split(state.rng)
    local_key = jax.random.fold_in(shared_key, ctx.replica_id_in_sync_group)
    rollout_key, shuffle_key = jax.random.split(local_key)

    runner, traj, last_value = rollout(
        graphdef,
        state.params,
        runner,
        rollout_key,
        cfg.rollout_steps,
        bootstrap_gamma=cfg.gamma if cfg.bootstrap_time_limit else None,
    )
    adv, target = gae(traj, last_value, cfg.gamma, cfg.gae_lambda)

    def flat(x):  # (T, E_local, ...) -> (T * E_local, ...)
        return x.reshape((-1,) + x.shape[2:])

    data = tuple(flat(x) for x in (traj.obs, traj.action, traj.log_prob, traj.value, adv, target))
    local_batch = data[0].shape[0]
    local_minibatch = local_batch // cfg.minibatches
    global_minibatch = local_minibatch * n
    grad_fn = jax.value_and_grad(_ppo_loss, has_aux=True)

    def epoch(state, key):
        perm = jax.random.permutation(key, local_batch)
        minis = tuple(
            x[perm].reshape((cfg.minibatches, local_minibatch) + x.shape[1:]) for x in data
        )

        def update(state, batch):
            (loss, parts), grads = grad_fn(state.params, graphdef, batch, cfg, global_minibatch)
            state = state.apply_gradients(grads=grads)  # sums grads over replicas
            return state, jnp.concatenate([loss[None], parts])

        return jax.lax.scan(update, state, minis)

    state, losses = jax.lax.scan(epoch, state, jax.random.split(shuffle_key, cfg.epochs))
    state = state.replace(rng=next_key)

    ended = traj.done.astype(jnp.float32)
    totals = ctx.all_reduce(
        "sum",
        {
            "episodes": ended.sum(),
            "return_sum": traj.episode_return.sum(),
            "losses": losses.mean(axis=(0, 1)),
        },
    )
    metrics = {
        "episodes": totals["episodes"],
        "return_sum": totals["return_sum"],
        "loss": totals["losses"][0],
        "policy_loss": totals["losses"][1],
        "value_loss": totals["losses"][2],
        "entropy": totals["losses"][3],
    }
    return state, runner, metrics


@functools.cache
def make_step(graphdef: nnx.GraphDef, cfg: PPOConfig):
    """The per-replica step for ``strategy.run``; one object per (model, config), so that
    runs with the same settings reuse the strategy's compiled step."""
    return functools.partial(ppo_iteration, graphdef=graphdef, cfg=cfg)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def evaluate(graphdef, params, key: jax.Array, num_envs: int = 64, greedy: bool = False):
    """Mean undiscounted return of one full episode in each of ``num_envs`` fresh CartPoles.

    Each environment runs until its first episode ends (at most 500 steps).
    """
    model = nnx.merge(graphdef, params)
    env, obs = cartpole.reset_batch(jax.random.split(key, num_envs))

    def body(carry, step_key):
        env, obs, finished, returns = carry
        act_key, env_key = jax.random.split(step_key)
        logits, _ = model(obs)
        action = jnp.argmax(logits, -1) if greedy else jax.random.categorical(act_key, logits)
        env, obs, _, done, info = cartpole.step_batch(
            env, action, jax.random.split(env_key, num_envs)
        )
        returns = jnp.where(done & ~finished, info.episode_return, returns)
        return (env, obs, finished | done, returns), None

    init = (env, obs, jnp.zeros(num_envs, bool), jnp.zeros(num_envs))
    (_, _, _, returns), _ = jax.lax.scan(
        body, init, jax.random.split(jax.random.fold_in(key, 1), cartpole.MAX_STEPS)
    )
    return returns.mean()


@dataclasses.dataclass
class TrainResult:
    """What a run measured; ``history`` has one row per iteration."""

    history: list[dict[str, float]]
    env_steps: int
    wall_time_s: float
    compile_time_s: float
    eval_return: float
    eval_return_greedy: float
    first_env_steps_at_target: int | None
    num_replicas: int
    params: PyTree = None


def _smoothed_returns(history: list[dict[str, float]], window: int) -> list[float]:
    """Mean return of the episodes that ended in the last ``window`` iterations."""
    out = []
    for i in range(len(history)):
        rows = history[max(0, i - window + 1) : i + 1]
        episodes = sum(r["episodes"] for r in rows)
        out.append(sum(r["return_sum"] for r in rows) / episodes if episodes else float("nan"))
    return out


def train(
    cfg: PPOConfig,
    strategy: dt.MirroredStrategy | None = None,
    *,
    target_return: float = 475.0,
    window: int = 10,
    log_every: int = 0,
    eval_episodes: int = 128,
) -> TrainResult:
    """Trains PPO under ``strategy`` for ``cfg.num_iterations`` iterations.

    Args:
        cfg: hyper-parameters.
        strategy: where to run; ``dt.MirroredStrategy()`` uses every local device.
            ``None`` uses the current/default strategy.
        target_return: the return whose first crossing (smoothed over ``window``
            iterations) is reported in ``first_env_steps_at_target``.
        window: iterations averaged for the smoothed training return.
        log_every: print a line every this many iterations (0: silent).
        eval_episodes: episodes of the final evaluation (sampled and greedy actions
            each); 0 skips it (the results are then NaN).

    Returns:
        A :class:`TrainResult` with the learning curve, timings and a final evaluation.
    """
    strategy = strategy or dt.get_strategy()
    n = strategy.num_replicas_in_sync
    cfg.validate(n)
    with strategy.scope():
        graphdef, state = init_state(cfg)
        state = strategy.put_replicated(state)
        runner = distribute_runner(init_runner(cfg), n)
        step = make_step(graphdef, cfg)

        history: list[dict[str, float]] = []
        start = time.perf_counter()
        compile_time = 0.0
        for it in range(cfg.num_iterations):
            state, runner, metrics = strategy.run(step, args=(state, runner))
            # One small host sync per iteration (thousands of env steps): the curve.
            row = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if it == 0:
                compile_time = time.perf_counter() - start
            row["env_steps"] = (it + 1) * cfg.steps_per_iteration
            row["time_s"] = time.perf_counter() - start
            history.append(row)
            if log_every and (it + 1) % log_every == 0:
                smooth = _smoothed_returns(history, window)[-1]
                print(
                    f"iter {it + 1}/{cfg.num_iterations} steps {row['env_steps']} "
                    f"return {smooth:.1f} loss {row['loss']:.3f} time {row['time_s']:.1f}s",
                    flush=True,
                )
        wall = time.perf_counter() - start

    smooth = _smoothed_returns(history, window)
    for row, value in zip(history, smooth, strict=True):
        row["return_smoothed"] = value
    first = next((r["env_steps"] for r in history if r["return_smoothed"] >= target_return), None)
    params = jax.device_get(state.params)
    eval_key = jax.random.key(cfg.seed + 1000)

    def score(greedy: bool) -> float:
        if not eval_episodes:
            return float("nan")
        return float(evaluate(graphdef, params, eval_key, eval_episodes, greedy))

    return TrainResult(
        history=history,
        env_steps=cfg.num_iterations * cfg.steps_per_iteration,
        wall_time_s=wall,
        compile_time_s=compile_time,
        eval_return=score(greedy=False),
        eval_return_greedy=score(greedy=True),
        first_env_steps_at_target=first,
        num_replicas=n,
        params=params,
    )
