"""CartPole-v1 written in JAX, so that whole rollouts compile into the training step.

The dynamics, constants, reward (1 per step, including the terminating one),
termination thresholds (|x| > 2.4, |theta| > 12 degrees) and the 500-step time
limit follow Gymnasium's ``CartPole-v1``. Episodes reset automatically: the
observation returned after a finished episode is the first one of the next.

Example:
    >>> import jax
    >>> state, obs = reset(jax.random.key(0))
    >>> state, obs, reward, done, info = step(state, jax.numpy.int32(1), jax.random.key(1))
    >>> float(reward)
    1.0
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
HALF_POLE_LENGTH = 0.5
POLE_MASS_LENGTH = MASS_POLE * HALF_POLE_LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds between state updates (explicit Euler)
X_THRESHOLD = 2.4
THETA_THRESHOLD = 12 * 2 * math.pi / 360
MAX_STEPS = 500

OBS_SIZE = 4
NUM_ACTIONS = 2


class EnvState(NamedTuple):
    """One CartPole's state: physics, step count and the running episode return."""

    physics: jax.Array  # (4,): x, x_dot, theta, theta_dot
    t: jax.Array  # steps taken in this episode
    episode_return: jax.Array


class StepInfo(NamedTuple):
    """What a step reports besides the reward: whether and how an episode ended."""

    terminated: jax.Array  # fell or left the track
    truncated: jax.Array  # hit the 500-step limit
    episode_return: jax.Array  # return of the episode that just ended (0 when none ended)
    final_obs: jax.Array  # the observation reached by this step, before any reset


def reset(key: jax.Array) -> tuple[EnvState, jax.Array]:
    """Starts an episode: all four state values uniform in [-0.05, 0.05]."""
    physics = jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)
    state = EnvState(physics=physics, t=jnp.int32(0), episode_return=jnp.float32(0.0))
    return state, physics


def _physics_step(physics: jax.Array, action: jax.Array) -> jax.Array:
    x, x_dot, theta, theta_dot = physics
    force = jnp.where(action == 1, FORCE_MAG, -FORCE_MAG)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + POLE_MASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (
        HALF_POLE_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / TOTAL_MASS)
    )
    x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
    return jnp.stack(
        [
            x + TAU * x_dot,
            x_dot + TAU * x_acc,
            theta + TAU * theta_dot,
            theta_dot + TAU * theta_acc,
        ]
    )


def step(
    state: EnvState, action: jax.Array, key: jax.Array
) -> tuple[EnvState, jax.Array, jax.Array, jax.Array, StepInfo]:
    """Advances one CartPole by 0.02 s and resets it (with ``key``) when the episode ends.

    Args:
        state: the environment's state.
        action: 0 pushes the cart left, 1 pushes it right.
        key: randomness for the reset that follows a finished episode.

    Returns:
        ``(state, obs, reward, done, info)``; ``done`` is terminated or truncated,
        and after ``done`` ``state``/``obs`` already belong to the next episode.
    """
    physics = _physics_step(state.physics, action)
    x, theta = physics[0], physics[2]
    terminated = (jnp.abs(x) > X_THRESHOLD) | (jnp.abs(theta) > THETA_THRESHOLD)
    t = state.t + 1
    truncated = (t >= MAX_STEPS) & ~terminated
    done = terminated | truncated
    reward = jnp.float32(1.0)
    episode_return = state.episode_return + reward

    fresh, fresh_obs = reset(key)
    next_state = jax.tree.map(
        lambda new, old: jnp.where(done, new, old),
        fresh,
        EnvState(physics=physics, t=t, episode_return=episode_return),
    )
    obs = jnp.where(done, fresh_obs, physics)
    info = StepInfo(
        terminated=terminated,
        truncated=truncated,
        episode_return=jnp.where(done, episode_return, 0.0),
        final_obs=physics,
    )
    return next_state, obs, reward, done, info


# Batched versions: one call steps a whole vector of environments.
reset_batch = jax.vmap(reset)
step_batch = jax.vmap(step)
