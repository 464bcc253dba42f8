"""A3C-style asynchronous actor-critic on CartPole with ``ParameterServerStrategy``.

The synchronous PPO of :mod:`train` all-reduces every update. Here there is no
synchronisation between workers: each worker runs a compiled step that

1. pulls the current parameters from the parameter servers (a host callback
   inside the compiled program, see ``distrain/_src/ps/step.py``),
2. steps its own environments for ``rollout_steps`` (the JAX CartPole, inside
   the program, as in :mod:`train`),
3. computes an advantage actor-critic gradient on that rollout and pushes it;
   the servers apply it with Adam as soon as it arrives (possibly after other
   workers' updates: the gradient may be *stale*, as in A3C).

The environments of each *actor slot* live on the host between steps: the loop
keeps one slot per worker in flight, and when a slot's step returns, its new
environment state goes into the next step scheduled for it, on whichever
worker is free.

Example:
    >>> result = train_a3c(A3CConfig(total_env_steps=20_000))  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# Not yet re-exported as dt.experimental.ParameterServerStrategy / dt.experimental.coordinator.
from distrain.experimental import ParameterServerStrategy
from distrain.experimental.coordinator import ClusterCoordinator

from . import train as ppo


@dataclasses.dataclass(frozen=True)
class A3CConfig:
    """Hyper-parameters of the asynchronous variant (defaults: the run in README.md)."""

    num_workers: int = 2
    """Asynchronous workers (in-process: threads, worker ``i`` on local device ``i``)."""
    envs_per_worker: int = 16
    rollout_steps: int = 32
    total_env_steps: int = 1_000_000
    learning_rate: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    normalize_advantages: bool = False
    """Per-rollout advantage normalisation; off: once every episode reaches 500 the
    advantages are mostly noise, and normalising blows that noise up to unit scale."""
    max_staleness: int | None = None
    """None: apply every gradient on arrival (A3C). See ``ParameterServerStrategy``."""
    seed: int = 0

    @property
    def steps_per_update(self) -> int:
        return self.envs_per_worker * self.rollout_steps

    @property
    def num_updates(self) -> int:
        return max(1, self.total_env_steps // self.steps_per_update)


def a3c_step(params, runner: ppo.Runner, key_data: jax.Array, *, graphdef, cfg: A3CConfig):
    """One worker step: rollout with the pulled params, then the actor-critic gradient.

    Returns ``(grads, outputs)`` as ``strategy.worker_step`` expects; ``outputs``
    carries the slot's new environment state and the finished episodes' returns.
    """
    key = jax.random.wrap_key_data(key_data)
    runner, traj, last_value = ppo.rollout(
        graphdef, params, runner, key, cfg.rollout_steps, bootstrap_gamma=cfg.gamma
    )
    adv, target = ppo.gae(traj, last_value, cfg.gamma, cfg.gae_lambda)
    if cfg.normalize_advantages:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)

    def loss_fn(p):
        logits, value = nnx.merge(graphdef, p)(traj.obs)
        log_probs = jax.nn.log_softmax(logits)
        log_prob = jnp.take_along_axis(log_probs, traj.action[..., None], axis=-1)[..., 0]
        entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
        per_step = (
            -log_prob * adv
            + cfg.value_coef * 0.5 * (value - target) ** 2
            - cfg.entropy_coef * entropy
        )
        return per_step.mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    # Clip here, on the worker: the servers' optimizer must be elementwise (each
    # server sees only its own pieces of the parameters).
    grads, _ = optax.clip_by_global_norm(cfg.max_grad_norm).update(grads, optax.EmptyState())
    ended = traj.done.astype(jnp.float32)
    outputs = {
        "runner": runner,
        "loss": loss,
        "episodes": ended.sum(),
        "return_sum": traj.episode_return.sum(),
    }
    return grads, outputs


@dataclasses.dataclass
class A3CResult:
    """What an asynchronous run measured; ``history`` has one row per finished update."""

    history: list[dict[str, float]]
    env_steps: int
    wall_time_s: float
    eval_return: float
    eval_return_greedy: float
    first_env_steps_at_target: int | None
    server_stats: list[dict[str, Any]]
    params: Any = None


def train_a3c(
    cfg: A3CConfig,
    *,
    target_return: float = 475.0,
    window: int = 40,
    eval_episodes: int = 128,
    log_every: int = 0,
) -> A3CResult:
    """Trains with ``cfg.num_workers`` asynchronous workers and one parameter server.

    Args:
        cfg: hyper-parameters.
        target_return: reported when the smoothed training return first reaches it.
        window: updates averaged for the smoothed return.
        eval_episodes: episodes of the final evaluation (0 skips it).
        log_every: print a line every this many updates (0: silent).
    """
    model = ppo.ActorCritic(cfg.hidden, rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model)
    lr = optax.linear_schedule(cfg.learning_rate, 0.0, cfg.num_updates)
    strategy = ParameterServerStrategy(
        num_workers=cfg.num_workers, num_ps=1, max_staleness=cfg.max_staleness
    )
    history: list[dict[str, float]] = []
    try:
        with strategy.scope():
            variables = strategy.create_variables(params, optax.adam(lr, eps=1e-5))
            step = strategy.worker_step(functools.partial(a3c_step, graphdef=graphdef, cfg=cfg))
            coordinator = ClusterCoordinator(strategy)
            root = jax.random.key(cfg.seed + 1)

            def launch(slot: int, runner: Any, n: int):
                key = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(root, slot), n))
                return coordinator.schedule(step, args=(runner, key))

            slots = []
            for s in range(cfg.num_workers):
                keys = jax.random.split(jax.random.fold_in(root, 10_000 + s), cfg.envs_per_worker)
                env, obs = ppo.cartpole.reset_batch(keys)
                slots.append(jax.device_get(ppo.Runner(env, obs)))
            # One step per slot in flight: every worker busy, no unbounded queue.
            in_flight = collections.deque(
                (s, launch(s, slots[s], 0)) for s in range(cfg.num_workers)
            )
            launched = cfg.num_workers
            start = time.perf_counter()
            while in_flight:
                slot, value = in_flight.popleft()
                out = value.fetch()
                row = {k: float(out[k]) for k in ("loss", "episodes", "return_sum")}
                row["env_steps"] = (len(history) + 1) * cfg.steps_per_update
                row["time_s"] = time.perf_counter() - start
                history.append(row)
                if log_every and len(history) % log_every == 0:
                    smooth = ppo._smoothed_returns(history, window)[-1]
                    print(
                        f"update {len(history)}/{cfg.num_updates} steps {row['env_steps']} "
                        f"return {smooth:.1f} {row['time_s']:.1f}s",
                        flush=True,
                    )
                if launched < cfg.num_updates:
                    in_flight.append((slot, launch(slot, out["runner"], launched)))
                    launched += 1
            coordinator.join()
            wall = time.perf_counter() - start
            final = variables.read()
            stats = strategy.stats()
    finally:
        strategy.shutdown()

    smooth = ppo._smoothed_returns(history, window)
    for row, v in zip(history, smooth, strict=True):
        row["return_smoothed"] = v
    first = next((r["env_steps"] for r in history if r["return_smoothed"] >= target_return), None)
    key = jax.random.key(cfg.seed + 1000)

    def score(greedy: bool) -> float:
        if not eval_episodes:
            return float("nan")
        return float(ppo.evaluate(graphdef, final, key, eval_episodes, greedy))

    return A3CResult(
        history=history,
        env_steps=len(history) * cfg.steps_per_update,
        wall_time_s=wall,
        eval_return=score(False),
        eval_return_greedy=score(True),
        first_env_steps_at_target=first,
        server_stats=stats,
        params=final,
    )
