"""Loss helpers with ``tf.distribute`` semantics, plus exact means on padded batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from distrain import context


def _replica_context(name: str) -> context.ReplicaContext:
    ctx = context.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            f"`dt.{name}` was called in the cross-replica context; it must be called in a "
            "replica context: inside the function passed to `strategy.run` (or outside any "
            "strategy scope)."
        )
    return ctx


def compute_average_loss(
    per_example_loss: ArrayLike,
    sample_weight: ArrayLike | None = None,
    global_batch_size: int | None = None,
    mask: ArrayLike | None = None,
) -> jax.Array:
    """Scales per-example losses so that summing over replicas gives the global mean.

    Returns ``sum(per_example_loss * sample_weight) / global_batch_size``. When
    ``global_batch_size`` is ``None`` it is the per-replica batch size times the number
    of replicas, as in TensorFlow, unless ``mask`` is given.

    Exact mean on a partial batch (the idiom): pad the last batch to the full size and
    pass ``mask`` (1 for real examples, 0 for padding). The loss is then divided by the
    number of real examples across *all* replicas (one scalar all-reduce), so the summed
    gradients are exactly those of the mean over the real examples:

      >>> per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      >>> loss = dt.compute_average_loss(per_example, mask=batch["mask"])

    Args:
      per_example_loss: losses of shape ``[batch, ...]`` (not a scalar).
      sample_weight: optional weights broadcastable to ``per_example_loss``.
      global_batch_size: the divisor; a positive int.
      mask: optional ``[batch]`` 0/1 weights marking real examples.

    Raises:
      ValueError: for a scalar loss or a non-positive ``global_batch_size``.
    """
    ctx = _replica_context("compute_average_loss")
    loss = jnp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise ValueError(
            "`compute_average_loss` expects per-example losses of shape [batch, ...]. "
            "Received a scalar (shape ()). Compute the loss per example (no reduction) "
            "and pass that."
        )
    if global_batch_size is not None and (
        not isinstance(global_batch_size, int) or global_batch_size <= 0
    ):
        raise ValueError(
            f"`global_batch_size` must be a positive int. Received: {global_batch_size!r}."
        )
    if sample_weight is not None:
        loss = loss * jnp.asarray(sample_weight, loss.dtype)
    if mask is not None:
        m = jnp.asarray(mask, loss.dtype)
        loss = loss * m.reshape(m.shape + (1,) * (loss.ndim - m.ndim))
        if global_batch_size is None:
            count = ctx.all_reduce("sum", jnp.sum(m))
            return jnp.sum(loss) / jnp.maximum(count, 1)
    if global_batch_size is None:
        global_batch_size = loss.shape[0] * ctx.num_replicas_in_sync
    return jnp.sum(loss) / jnp.asarray(global_batch_size, loss.dtype)


def scale_regularization_loss(regularization_loss: ArrayLike) -> jax.Array:
    """Divides a regularization loss by the number of replicas, so that summing over
    replicas (as gradient all-reduce does) counts it once.

    Example:
      >>> loss = dt.compute_average_loss(per_example) + dt.scale_regularization_loss(l2)
    """
    ctx = _replica_context("scale_regularization_loss")
    loss = jnp.asarray(regularization_loss)
    return loss / jnp.asarray(ctx.num_replicas_in_sync, loss.dtype)
