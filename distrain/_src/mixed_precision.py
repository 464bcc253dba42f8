"""Mixed precision in Keras' vocabulary: ``"float32"``, ``"mixed_bfloat16"``, ``"mixed_float16"``.

A policy keeps parameters and optimizer state in float32 (master weights) and runs
the step in its compute dtype. It is set once, on the state
(``dt.TrainState.create(..., policy="mixed_bfloat16")``), and a step takes gradients
through ``state.value_and_grad``, which:

1. casts the floating inputs of the loss function (parameters and batch) to the
   compute dtype, so the forward and backward passes run in it;
2. with ``mixed_float16``, multiplies the loss by the dynamic loss scale before
   differentiating (float16 gradients underflow without it) and divides the gradients
   by it after;
3. returns the loss and the gradients in float32, the parameters' dtype, so the
   all-reduce and the optimizer update run in full precision.

``state.apply_gradients`` then skips an update whose (all-reduced) gradients are not
finite and halves the scale; after ``growth_interval`` finite steps in a row it doubles
it, as Keras' ``LossScaleOptimizer`` does. The scale is part of the state, so it is in
every checkpoint and a resumed run continues with it.

Example:
  >>> state = dt.TrainState.create(params=p, tx=optax.adam(1e-3), policy="mixed_bfloat16")
  >>> def train_step(state, batch):
  ...     loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
  ...     return state.apply_gradients(grads=grads), loss
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["DynamicLossScale", "Policy"]

_POLICIES = {
    "float32": (jnp.float32, False),
    "mixed_bfloat16": (jnp.bfloat16, False),
    "mixed_float16": (jnp.float16, True),
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named mixed-precision policy.

    Attributes:
      name: ``"float32"``, ``"mixed_bfloat16"`` or ``"mixed_float16"``.
      compute_dtype: the dtype the step computes in.
      param_dtype: the dtype of parameters, optimizer state and gradients (float32).
      loss_scaling: whether gradients need a dynamic loss scale (float16).

    Raises:
      ValueError: an unknown name (the message lists the valid ones).
    """

    name: str

    def __post_init__(self) -> None:
        if self.name not in _POLICIES:
            raise ValueError(
                f"Unknown mixed-precision policy {self.name!r}. Expected one of "
                f"{sorted(_POLICIES)}."
            )

    @property
    def compute_dtype(self) -> Any:
        return _POLICIES[self.name][0]

    @property
    def param_dtype(self) -> Any:
        return jnp.float32

    @property
    def loss_scaling(self) -> bool:
        return _POLICIES[self.name][1]

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating leaves of ``tree`` in the compute dtype (others unchanged)."""
        return _cast(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Floating leaves of ``tree`` in the parameter dtype (float32)."""
        return _cast(tree, self.param_dtype)


def policy_of(policy: Policy | str | None) -> Policy | None:
    """``policy`` as a :class:`Policy` (None and ``"float32"`` mean full precision)."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy(policy)
    raise TypeError(
        f"`policy` must be a policy name ({sorted(_POLICIES)}) or a dt.mixed_precision.Policy. "
        f"Received: {policy!r}."
    )


def _cast(tree: Any, dtype: Any) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array | float) or hasattr(x, "dtype"):
            x = jnp.asarray(x)
            if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
                return x.astype(dtype)
        return x

    return jax.tree.map(one, tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Keras' dynamic loss scale: halve on overflow, double after enough good steps.

    Attributes:
      scale: the current scale (float32 scalar).
      good_steps: finite steps since the last change (int32 scalar).
      growth_interval: finite steps in a row before the scale doubles (static).
    """

    scale: jax.Array
    good_steps: jax.Array
    growth_interval: int = dataclasses.field(default=2000, metadata={"static": True})

    @classmethod
    def create(
        cls, initial_scale: float = 2.0**15, growth_interval: int = 2000
    ) -> DynamicLossScale:
        return cls(
            scale=jnp.asarray(initial_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            growth_interval=growth_interval,
        )

    def adjust(self, finite: jax.Array) -> DynamicLossScale:
        """The scale after a step whose gradients were (not) all finite."""
        grow = finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(
            finite, jnp.where(grow, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0)
        )
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return dataclasses.replace(self, scale=scale, good_steps=good.astype(jnp.int32))


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
