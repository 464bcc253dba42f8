"""The worker step: one compiled program that pulls, computes and pushes.

``strategy.worker_step(fn)`` wraps a user function
``fn(params, *args, **kwargs) -> (grads, outputs)`` into a `WorkerStep`. On a
worker it becomes one ``jax.jit`` program:

1. an ordered ``io_callback`` pulls the current params from the parameter
   servers (host memory -> the worker's device);
2. ``fn`` runs on them (compiled; ``grads`` must be shaped like ``params``);
3. an ordered ``io_callback`` pushes ``grads`` to the servers, which queue
   them for their optax update and return at once.

The callbacks receive a *ticket* ``[seq, worker, runtime]`` so the host side
knows which scheduled step, which worker and which strategy is calling;
nothing else is shared between the compiled program and the host.

Example:
    >>> def step_fn(params, batch):
    ...     loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    ...     return grads, {"loss": loss}
    >>> step = strategy.worker_step(step_fn)
    >>> coordinator.schedule(step, args=(per_worker_iterator,)).fetch()["loss"]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import io_callback

from distrain._src.ps.variable_layout import Layout

if TYPE_CHECKING:
    from distrain._src.ps.ps_strategy import ParameterServerStrategy

_ids = itertools.count()

StepFn = Callable[..., tuple[Any, Any]]


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_result(result: Any, sig: _Signature, fn: Any) -> tuple[list[jax.Array], Any]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"The step function {_name(fn)} of strategy.worker_step must return a pair "
            f"(grads, outputs). Received: {type(result).__name__}"
            f"{f' of length {len(result)}' if isinstance(result, tuple) else ''}. Return "
            "`grads, {'loss': loss}` (outputs may be None)."
        )
    grads, outputs = result
    leaves, treedef = jax.tree.flatten(grads)
    if treedef != sig.treedef:
        raise ValueError(
            f"The grads returned by {_name(fn)} must have the structure of the params. "
            f"Expected: {sig.treedef}. Received: {treedef}."
        )
    cast = []
    for path, spec, g in zip(sig.paths, sig.specs, leaves, strict=True):
        if tuple(g.shape) != tuple(spec.shape):
            raise ValueError(
                f"The gradient of {path} returned by {_name(fn)} has shape {tuple(g.shape)}; "
                f"expected the shape of the parameter, {tuple(spec.shape)}."
            )
        cast.append(g.astype(spec.dtype))
    return cast, outputs


# Host callbacks reach the runtime of their process through the ticket
# ``[seq, worker, runtime id]``, so one compiled program serves every strategy
# of a process that uses the same step function and params shapes.
RUNTIMES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _pull(ticket: np.ndarray) -> list[np.ndarray]:
    return RUNTIMES[int(ticket[2])].pull_callback(ticket)


def _push(ticket: np.ndarray, *grads: np.ndarray) -> np.int32:
    return RUNTIMES[int(ticket[2])].push_callback(ticket, *grads)


@dataclasses.dataclass(frozen=True)
class _Signature:
    """What the compiled program knows of the params: structure, names, shapes, dtypes."""

    treedef: Any
    paths: tuple[str, ...]
    specs: tuple[jax.ShapeDtypeStruct, ...]


@functools.lru_cache(maxsize=64)
def _compile(fn: StepFn, signature: _Signature) -> Callable[..., Any]:
    return jax.jit(functools.partial(_program, fn, signature))


class StepProgram:
    """The user function and the params signature: what a worker compiles.

    Picklable (Ray workers receive it).
    """

    def __init__(self, fn: StepFn, layout: Layout):
        self.fn = fn
        self.signature = _Signature(layout.treedef, tuple(layout.paths), tuple(layout.leaf_specs))

    def compiled(self) -> Callable[..., Any]:
        """``program(ticket, args, kwargs) -> (outputs, pushed)``, jitted."""
        try:
            return _compile(self.fn, self.signature)
        except TypeError:  # an unhashable callable: compile for this program only
            if not hasattr(self, "_own"):
                self._own = jax.jit(functools.partial(_program, self.fn, self.signature))
            return self._own


def _program(fn: StepFn, sig: _Signature, ticket: jax.Array, args, kwargs):
    leaves = io_callback(_pull, list(sig.specs), ticket, ordered=True)
    params = sig.treedef.unflatten(leaves)
    grads, outputs = _check_result(fn(params, *args, **kwargs), sig, fn)
    pushed = io_callback(_push, jax.ShapeDtypeStruct((), np.int32), ticket, *grads, ordered=True)
    return outputs, pushed


class WorkerStep:
    """A step function built for one `ParameterServerStrategy`; schedule it on workers.

    Create it with ``strategy.worker_step(fn)``. It cannot be called directly:
    it runs on workers, through ``ClusterCoordinator.schedule``.
    """

    def __init__(self, strategy: ParameterServerStrategy, fn: StepFn):
        if not callable(fn):
            raise TypeError(
                "strategy.worker_step expects a function fn(params, *args) -> (grads, outputs). "
                f"Received: {fn!r}."
            )
        self.strategy = strategy
        self.fn = fn
        self._program: StepProgram | None = None
        self.step_id = next(_ids)
        functools.update_wrapper(self, fn, updated=())

    @property
    def program(self) -> StepProgram:
        """The step and the variables' layout (needs ``strategy.create_variables`` first)."""
        if self._program is None:
            layout = self.strategy.server_group(f"running {self!r}").layout
            self._program = StepProgram(self.fn, layout)
        return self._program

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{_name(self.fn)} is a worker step: it runs on the workers of its strategy. "
            "Schedule it with `coordinator.schedule(step, args=(...))` and read the result "
            "with `.fetch()`."
        )

    def __repr__(self) -> str:
        return f"WorkerStep({_name(self.fn)})"
