"""Checks of what users pass to ``strategy.run`` and what their replica functions do.

Argument checks run on every call only where they are one type test; everything else
runs once per compiled program (at trace time) or when a call has already failed
(:func:`diagnose_per_replica`), so the steady-state hot path pays nothing for them.
"""

from __future__ import annotations

import collections.abc
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from distrain._src.values import PerReplica

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy

_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax", "grain")


def check_placeable(tree: Any) -> Any:
    """``tree`` if every leaf is an array or a number, else a TypeError naming the leaf."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex):
            raise TypeError(
                f"State leaves must be arrays or numbers; the leaf at "
                f"`{jax.tree_util.keystr(path) or 'the top level'}` is a "
                f"{type(leaf).__name__} ({leaf!r:.60}). Keep non-array values out of the "
                "state pytree (e.g. as a `struct.field(pytree_node=False)` of a dataclass)."
            )
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind not in "biufc":
            raise TypeError(
                f"State leaves must have a numeric dtype; the leaf at "
                f"`{jax.tree_util.keystr(path)}` has dtype {leaf.dtype}."
            )
    return tree


def check_run_dtypes(fn: Any, args: tuple, kwargs: dict) -> None:
    """A NumPy argument of ``run`` that cannot go to the devices (strings, objects): a
    TypeError naming it, instead of JAX's error from inside the compiled call."""
    named = [(f"args[{i}]", a) for i, a in enumerate(args)]
    named += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    for name, tree in named:
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, np.ndarray | np.generic) and leaf.dtype.kind not in "biufc":
                raise TypeError(
                    f"`strategy.run({fn_name(fn)}, ...)`: the argument "
                    f"{name}{jax.tree_util.keystr(path)} is a NumPy array of dtype "
                    f"{leaf.dtype}; only numeric and bool arrays can go to the devices. "
                    "Leave it out of the arguments, encode it as numbers, or pass it as a "
                    "plain Python value (a compile-time constant)."
                )


def check_replica_values(replicas: list[int], values: list[Any]) -> list[list[Any]]:
    """The leaves of each replica's value from ``value_fn``, checked to stack into one
    per-replica value: same structure, one shape per leaf, numeric dtypes."""
    treedef = jax.tree.structure(values[0])
    paths = [
        jax.tree_util.keystr(p) or "the value"
        for p, _ in jax.tree_util.tree_leaves_with_path(values[0])
    ]
    out = []
    for r, v in zip(replicas, values, strict=True):
        leaves, tree = jax.tree.flatten(v)
        if tree != treedef:  # type: ignore[operator]
            raise ValueError(
                "`experimental_distribute_values_from_function`: every replica's value must "
                f"have the same structure. Replica {replicas[0]}: {treedef}; replica {r}: "
                f"{tree}."
            )
        out.append(leaves)
    for j, path in enumerate(paths):
        x = out[0][j]
        dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        if dtype.kind not in "biufc":
            raise TypeError(
                f"`experimental_distribute_values_from_function`: {path} has dtype {dtype}; "
                "only numeric and bool values can go to the devices."
            )
        shapes = {r: tuple(np.shape(leaves[j])) for r, leaves in zip(replicas, out, strict=True)}
        if len(set(shapes.values())) > 1:
            by_shape: dict[tuple[int, ...], list[int]] = {}
            for r, shape in shapes.items():
                by_shape.setdefault(shape, []).append(r)
            listed = "; ".join(f"{shape} on replicas {rs}" for shape, rs in by_shape.items())
            raise ValueError(
                "`experimental_distribute_values_from_function`: every replica's value must "
                f"have the same shape, to be one array with a row per replica; {path} has "
                f"shape {listed}. Pad the values to one shape (and mask), or give each "
                "replica the same shape."
            )
    return out


def fn_name(fn: Any) -> str:
    """A short name for messages and compiled programs: ``step``, ``partial(step)``.

    Never a ``repr``: a ``functools.partial``'s holds its arguments (a model's whole
    graph), and as a program's name it made file names too long for jax's persistent
    compilation cache (an error writing every entry, and no entry written).
    """
    if isinstance(fn, functools.partial):
        return f"partial({fn_name(fn.func)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def check_run_arguments(
    fn: Any, args: Any, kwargs: Any, donate_argnums: Any
) -> tuple[tuple, dict, tuple[int, ...]]:
    """``run``'s arguments as TF takes them: a callable, a sequence of args, a mapping."""
    if not callable(fn):
        raise TypeError(
            f"`strategy.run(fn, ...)` needs a function as `fn`. Received: {fn!r} of type "
            f"{type(fn).__name__}."
        )
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"`strategy.run({fn_name(fn)}, args=...)` takes a tuple of positional arguments. "
            f"Received a {type(args).__name__}; for one argument write `args=(x,)`."
        )
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, collections.abc.Mapping):
        raise TypeError(
            f"`strategy.run({fn_name(fn)}, kwargs=...)` takes a mapping of keyword arguments. "
            f"Received a {type(kwargs).__name__}."
        )
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)  # as jax.jit accepts
    return tuple(args), dict(kwargs), tuple(donate_argnums)


def _tracers(value: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value))


def _captured(fn: Any, depth: int = 6, seen: set[int] | None = None) -> dict[str, Any]:
    """The global and enclosing variables ``fn`` reads, and those of the functions it
    reads that are not library code (trace-time diagnostics only)."""
    seen = set() if seen is None else seen
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    names: dict[str, Any] = {}
    if code is None or id(fn) in seen or depth == 0:
        return names
    seen.add(id(fn))
    glob = getattr(fn, "__globals__", {})
    names.update({n: glob[n] for n in code.co_names if n in glob})
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            names[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    for value in list(names.values()):
        module = getattr(value, "__module__", None) or ""
        if callable(value) and module.split(".")[0] not in _LIBRARIES:
            names.update(_captured(value, depth - 1, seen))
    return names


def check_no_leaks(fn: Any) -> None:
    """Raises when tracing ``fn`` left traced values in its global or enclosing variables.

    ``run`` traces a replica function once: a TF-style step that assigns its new state
    to a variable instead of returning it would train nothing (a constant loss).
    """
    leaked = sorted(n for n, v in _captured(fn).items() if _tracers(v))
    if leaked:
        raise RuntimeError(
            f"`{fn_name(fn)}` stored traced values in {leaked} (global or enclosing "
            "variables) instead of returning them. `strategy.run` compiles the function "
            "once, so state must flow through arguments and results: pass the state in and "
            "return the new one, e.g. `def step(state, batch): ...; return new_state, loss` "
            "and `state, loss = strategy.run(step, args=(state, batch))`."
        )


def check_traced_step(fn: Any, args: tuple, kwargs: dict, inputs: list, out: Any) -> None:
    """Catches a TF-style step that mutates state instead of returning it (at trace time).

    ``run`` traces ``fn`` once: a step that assigns new values to a global or enclosing
    variable, or changes its arguments in place, would leave the traced values behind and
    train nothing (a constant loss), so it is an error.
    """
    check_no_leaks(fn)
    after = jax.tree.leaves((args, kwargs))
    if len(after) != len(inputs) or any(a is not b for a, b in zip(after, inputs, strict=True)):
        raise RuntimeError(
            f"`{fn_name(fn)}` changed its arguments in place. `strategy.run` compiles the "
            "function once and does not see in-place changes: return the new values instead "
            "(e.g. `return state.replace(params=new_params), loss`)."
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | bool):
            raise TypeError(
                f"`{fn_name(fn)}` returned a {type(leaf).__name__} at "
                f"`{jax.tree_util.keystr(path) or 'the top level'}`; a replica function "
                "returns a pytree of arrays (or Python numbers)."
            )


def check_captured_consts(fn: Any, consts: Sequence[Any]) -> None:
    """Refuses arrays placed by a strategy that ``fn`` reads from globals or closures."""
    placed = [
        c
        for c in consts
        if isinstance(c, jax.Array)
        and not isinstance(c, jax.core.Tracer)
        and len(c.sharding.device_set) > 1
    ]
    if not placed:
        return
    names = sorted(
        n
        for n, v in _captured(fn).items()
        if any(x is c for x in jax.tree.leaves(v) for c in placed)
    )
    raise ValueError(
        f"`{fn_name(fn)}` reads arrays placed on several devices from "
        f"{names or 'global or enclosing variables'} instead of taking them as arguments. "
        "Pass the state to the step and return the new one: "
        "`state, loss = strategy.run(step, args=(state, batch))`."
    )


def hashable_constants(static: list[Any], fn: Any) -> tuple:
    try:
        hash(tuple(static))
    except TypeError as e:
        raise TypeError(
            f"Arguments of `strategy.run({fn_name(fn)})` that are not arrays "
            "are compile-time constants and must be hashable. Received unhashable values: "
            f"{[type(s).__name__ for s in static]}. Pass arrays, or bind the value with "
            "functools.partial."
        ) from e
    # The type too: 2 and 2.0 hash equal but trace differently.
    return tuple((type(s), s) for s in static)


def check_per_replica(strategy: Strategy, value: PerReplica, leaves: list[Any]) -> None:
    """A per-replica argument must be made for this strategy's replicas and devices."""
    n = strategy.num_replicas_in_sync
    if value.num_replicas != n:
        raise ValueError(
            f"A PerReplica value made for {value.num_replicas} replicas was passed to a "
            f"strategy with {n} replicas. Distribute the data with this strategy."
        )
    ours = set(strategy.devices)
    for x in leaves:
        if isinstance(x, jax.Array) and not x.sharding.device_set <= ours:
            raise ValueError(
                "A PerReplica value placed on other devices than this strategy's was "
                f"passed to {strategy!r}: its devices are "
                f"{sorted(str(d) for d in x.sharding.device_set)}, the strategy's "
                f"{[str(d) for d in strategy.devices]}. Distribute the data with this "
                "strategy (strategy.experimental_distribute_dataset / distribute_batch)."
            )
    for x in leaves:
        if not x.shape or x.shape[0] % n:
            raise ValueError(
                f"Each PerReplica leaf needs a leading axis divisible by the number of "
                f"replicas ({n}). Received shape {tuple(x.shape)}."
            )


def diagnose_per_replica(strategy: Strategy, args: tuple, kwargs: dict) -> None:
    """Raises the clear error for a bad per-replica argument, if there is one."""
    for leaf in jax.tree.leaves((args, kwargs), is_leaf=lambda x: isinstance(x, PerReplica)):
        if isinstance(leaf, PerReplica):
            check_per_replica(strategy, leaf, jax.tree.leaves(leaf.value))
