"""``TrainState``: the immutable pytree a train step reads and returns."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from distrain import context


@struct.dataclass
class TrainState:
    """Step counter, parameters, optimizer state, RNG key and extra collections.

    ``extra`` holds other mutable collections (e.g. ``{"batch_stats": ...}``).
    Any other pytree works as Trainer state too (e.g. two of these for a GAN).

    Example:
      >>> state = dt.TrainState.create(params=params, tx=optax.adam(1e-3), rng=jax.random.key(0))
      >>> def train_step(state, batch):
      ...     grads = jax.grad(loss_fn)(state.params, batch)
      ...     return state.apply_gradients(grads=grads), {}
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array | None = None
    extra: dict[str, Any] = struct.field(default_factory=dict)
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        tx: optax.GradientTransformation,
        rng: jax.Array | None = None,
        **extra: Any,
    ) -> TrainState:
        """A state at step 0 with ``tx``'s freshly initialised optimizer state."""
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=rng,
            extra=dict(extra),
            tx=tx,
        )

    def apply_gradients(self, *, grads: Any, all_reduce: bool = True, **changes: Any) -> TrainState:
        """One optimizer update with ``grads``.

        Inside ``strategy.run`` the gradients are first summed over replicas, as
        ``apply_gradients`` does under a TensorFlow strategy: with
        ``dt.compute_average_loss`` that is the gradient of the global mean loss.
        Pass ``all_reduce=False`` when they are already reduced (or to keep them local).

        Args:
          grads: a pytree like ``params``.
          all_reduce: sum ``grads`` over replicas first (in a replica context).
          **changes: other fields to replace, e.g. ``extra=...``.
        """
        if jax.tree.structure(grads) != jax.tree.structure(self.params):
            raise ValueError(
                "`apply_gradients(grads=...)` needs gradients with the structure of "
                f"`params`. Received:\n  grads:  {jax.tree.structure(grads)}\n  params: "
                f"{jax.tree.structure(self.params)}\nTake the gradient with respect to "
                "state.params, e.g. `jax.grad(loss_fn)(state.params, batch)`."
            )
        ctx = context.get_replica_context()
        if all_reduce and ctx is not None:
            grads = ctx.all_reduce("sum", grads)
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **changes)
