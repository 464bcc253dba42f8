"""The per-replica functions the Trainer hands to ``strategy.run``.

Each wraps a user step so that one dispatch does all the device work of a loop
iteration and nothing more:

* ``train``: ``k`` steps (unrolled over ``k`` batches when ``k > 1``),
  the step metrics summed over the ``k`` steps and added to an on-device accumulator.
  The accumulator stays per replica (a ``PerReplica`` value): metric sums are
  reduced over replicas only when the host reads them, every ``log_every`` steps,
  so a training step adds no collective and never waits for the device.
* ``eval``: one batch's metrics added to the (per-replica) accumulator.
* ``predict``: one batch's outputs (and its padding mask, if any).

They are cached per user step (and ``k``): ``strategy.run`` compiles per function
object, so a new ``Trainer`` for the same step reuses the compiled programs.

They also check what the user's step returns, at trace time, so a wrong structure is
an error that says what was expected instead of a failure deep inside the trace.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from distrain._src import context
from distrain._src.strategy._checks import check_no_leaks
from distrain._src.train import metrics as metrics_lib

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy

Step = Callable[..., Any]


def _name(fn: Any) -> str:
    """The user's name for a step: through the framework's wrappers (``__wrapped__``,
    e.g. the device-input gather, gradient accumulation) and ``functools.partial``."""
    fn = inspect.unwrap(fn)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "step")
    return str(name)


def _describe_tree(tree: Any) -> str:
    shapes = jax.tree.map(lambda x: f"{jnp.dtype(x.dtype).name}{list(x.shape)}", tree)
    text = str(shapes)
    return text if len(text) < 300 else text[:300] + "..."


def check_pair(step: Step, out: Any) -> tuple[Any, Any]:
    """``out`` as ``(new_state, metrics)``.

    Raises:
      TypeError: ``out`` is not a pair; the message names the user's step.
    """
    if not isinstance(out, tuple) or len(out) != 2:
        got = f"a tuple of length {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            f"`{_name(step)}` must return a tuple (new_state, metrics): the updated state and "
            f"a dict of scalar metrics. Received: {got}."
        )
    return out[0], out[1]


def check_train_output(step: Step, state: Any, out: Any) -> tuple[Any, dict[str, Any]]:
    """Validates ``out = train_step(state, batch)``; returns ``(new_state, metrics)``.

    Raises:
      TypeError: if ``out`` is not ``(new_state, metrics)`` with ``new_state`` shaped
        like ``state`` and ``metrics`` a dict of scalars / metrics.
    """
    name = _name(step)
    new_state, metrics = check_pair(step, out)
    expected, received = jax.tree.structure(state), jax.tree.structure(new_state)
    # The ignores: jaxlib ships no stubs for PyTreeDef, so mypy cannot see its
    # __eq__/__ne__ (structures compare by value at runtime).
    if expected != received:  # type: ignore[operator]
        hint = ""
        if isinstance(new_state, dict) and (
            jax.tree.structure(metrics) == expected  # type: ignore[operator]
        ):
            hint = " It looks like (metrics, new_state): return (new_state, metrics)."
        raise TypeError(
            f"`{name}` must return (new_state, metrics) where new_state has the same pytree "
            f"structure as the state it received.{hint}\n  expected: {expected}\n  received: "
            f"{received}"
        )
    for (path, old), new in zip(
        jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(new_state), strict=True
    ):
        if jnp.shape(old) != jnp.shape(new) or jnp.result_type(old) != jnp.result_type(new):
            raise TypeError(
                f"`{name}` returned a new state whose leaf {jax.tree_util.keystr(path)} changed "
                f"from {jnp.result_type(old).name}{list(jnp.shape(old))} to "
                f"{jnp.result_type(new).name}{list(jnp.shape(new))}. Expected every leaf to keep "
                "its shape and dtype across steps (cast it back, e.g. x.astype(old.dtype))."
            )
    return new_state, metrics_lib.normalize(metrics, where=name)


def run_train_step(step: Step, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    """``step(state, batch)``, checked, with ``compute_average_loss`` values recognised."""
    with context._recording_shares():
        return check_train_output(step, state, step(state, batch))


def pack(metrics: Any) -> jax.Array:
    """All metric sums of ``metrics`` as one float32 vector (flatten order).

    One accumulator buffer instead of one per metric leaf: every extra buffer costs
    a little on every dispatch and every device.
    """
    leaves = jax.tree.leaves(metrics)
    if not leaves:  # one unused slot: see Layout.size
        return jnp.zeros((1,), jnp.float32)
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


class Layout:
    """How a packed accumulator vector maps back to the metrics dict (on the host)."""

    def __init__(self, shapes: Any) -> None:
        leaves, self.treedef = jax.tree.flatten(shapes)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.offsets = np.cumsum([0] + [int(np.prod(s)) for s in self.shapes])
        # At least one slot: jaxlib 0.11.2's XLA:CPU crashed (SIGSEGV) compiling a step
        # whose zero-size accumulator, f32[replicas, 0], crossed the replica shard_map.
        self.size = max(1, int(self.offsets[-1]))

    def unpack(self, vector: Any) -> Any:
        """The metrics dict with float64 NumPy leaves from a packed vector."""
        v = np.asarray(vector, np.float64)
        leaves = [
            v[a:b].reshape(shape)
            for a, b, shape in zip(self.offsets[:-1], self.offsets[1:], self.shapes, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, leaves)


@functools.lru_cache(maxsize=64)
def make_train_fn(train_step: Step, num_steps: int) -> Callable[..., Any]:
    """``fn(state, acc, *batches) -> (state, acc)`` running ``num_steps`` steps per call.

    ``acc`` is this replica's running metric sums (the Trainer passes it as a stacked
    ``PerReplica``, so each replica keeps its own).
    """

    def one(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        return run_train_step(train_step, state, batch)

    # One name, two signatures (a batch, or num_steps batches): declared for both.
    train_fn: Callable[..., tuple[Any, Any]]
    if num_steps == 1:

        def train_fn(state: Any, acc: Any, batch: Any) -> tuple[Any, Any]:
            state, m = one(state, batch)
            return state, acc + pack(m)

    else:

        def packed(state: Any, batch: Any) -> tuple[Any, jax.Array]:
            state, m = one(state, batch)
            return state, pack(m)

        def train_fn(state: Any, acc: Any, *batches: Any) -> tuple[Any, Any]:
            # Unrolled rather than lax.scan: no stacking copy, and XLA:CPU runs
            # convolutions inside a scan loop several times slower (benchmarks/).
            for batch in batches:
                state, m = packed(state, batch)
                acc = acc + m
            return state, acc

    train_fn.__name__ = f"train_{num_steps}_{_name(train_step)}"
    train_fn.__wrapped__ = train_step  # type: ignore[union-attr]  # whose steps it runs
    return train_fn


@functools.lru_cache(maxsize=64)
def make_metrics_fn(train_step: Step) -> Callable[..., Any]:
    """``fn(state, batch) -> metrics`` (normalized): only traced, for the metric shapes."""

    def metrics_fn(state: Any, batch: Any) -> Any:
        return run_train_step(train_step, state, batch)[1]

    metrics_fn.__wrapped__ = train_step  # type: ignore[attr-defined]
    return metrics_fn


@functools.lru_cache(maxsize=64)
def make_eval_fn(eval_step: Step) -> Callable[..., Any]:
    """``fn(state, acc, batch) -> acc`` adding one batch's metrics (per replica)."""
    name = _name(eval_step)

    def metrics_fn(state: Any, batch: Any) -> Any:
        with context._recording_shares():
            out = eval_step(state, batch)
            if isinstance(out, tuple):
                raise TypeError(
                    f"`{name}` must return a dict of metrics (scalars or dt.metrics objects), "
                    f"not a tuple of length {len(out)}. An eval step does not return a state."
                )
            return metrics_lib.normalize(out, where=name)

    def eval_fn(state: Any, acc: Any, batch: Any) -> Any:
        return acc + pack(metrics_fn(state, batch))

    eval_fn.__name__ = f"eval_{name}"
    eval_fn.metrics_fn = metrics_fn  # type: ignore[attr-defined]
    return eval_fn


@functools.lru_cache(maxsize=64)
def make_predict_fn(predict_step: Step, mask_key: str | None) -> Callable[..., Any]:
    """``fn(state, batch) -> (outputs, mask or None)``; outputs are per example."""

    def predict_fn(state: Any, batch: Any) -> Any:
        out = predict_step(state, batch)
        rows = jax.tree.leaves(batch)[0].shape[0]
        for path, leaf in jax.tree_util.tree_leaves_with_path(out):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != rows:
                raise TypeError(
                    f"`{_name(predict_step)}` must return per-example outputs whose leading "
                    f"axis is the batch ({rows} rows per replica). Received "
                    f"{jax.tree_util.keystr(path) or 'output'} of shape {list(jnp.shape(leaf))}."
                )
        mask = batch.get(mask_key) if isinstance(batch, dict) and mask_key else None
        return out, mask

    predict_fn.__name__ = f"predict_{_name(predict_step)}"
    return predict_fn


def trace_shapes(strategy: Strategy, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """The output shapes of the replica function ``fn(*args)`` without running it.

    Traces ``fn`` as ``strategy.run`` would (per-replica shapes, replica context and
    axis name bound) so the Trainer can build a zero accumulator of the right
    structure before the first dispatch, instead of compiling a second variant.
    """
    shapes = strategy.eval_shape(fn, tuple(args))
    check_no_leaks(fn)
    return shapes


def per_replica_zeros(strategy: Strategy, size: int) -> Any:
    """A stacked ``PerReplica`` float32 accumulator ``[size]`` of zeros per replica."""
    zeros = np.zeros((size,), np.float32)
    return strategy.experimental_distribute_values_from_function(lambda ctx: zeros)
