"""A replica is a small named mesh: ``devices_per_replica`` resolved into inner axes.

The strategy's mesh is ``("replica", *inner_axes)``. ``strategy.run`` is manual over
``"replica"`` (each replica runs the per-replica function; collectives cross replicas)
and leaves every inner axis to XLA's partitioner, so inside a replica the function sees
its values whole while XLA keeps them split over the replica's devices.

``devices_per_replica`` takes:

* an int ``k``: one inner axis ``"model"`` of size ``k`` (1: one replica per device, a
  1-D mesh ``("replica",)``, no inner axis at all);
* ``"process"``: one replica per process, ``{"model": devices per process}``;
* an ordered mapping of named inner axes, e.g. ``{"fsdp": 4, "tensor": 2}``: their
  product is the number of devices per replica, and the names are what layouts,
  ``with_sharding_constraint`` and the framework ops (``"context"``, ``"stage"``) use.

A replica's devices are neighbours in process order: either a replica stays inside one
process (the product divides every process's devices), or it spans whole processes
(the product is a multiple of the devices per process, all processes alike). The last
inner axis varies fastest over neighbouring devices, so put the axis that talks most
(``"tensor"``) last: it then stays inside a host.

Example:
  >>> resolve_inner_axes({"fsdp": 4, "tensor": 2}, jax.devices())   # 8 devices
  {'fsdp': 4, 'tensor': 2}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

INNER_AXIS = "model"

DevicesPerReplica = int | Literal["process"] | Mapping[str, int]


def resolve_inner_axes(value: Any, devices: Sequence[jax.Device], axis: str) -> dict[str, int]:
    """``devices_per_replica`` as ``{inner axis: size}`` (empty: one replica per device).

    Raises:
      ValueError: a value of another type, axis names that are not distinct strings or
        name the replica axis ``axis``, sizes that are not positive ints, a product that
        does not divide the devices, or replicas that would cut a process in pieces.
    """
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    counts = set(per_process.values())
    if value == "process":
        if len(counts) != 1:
            raise ValueError(
                "devices_per_replica='process' needs the same number of devices in every "
                f"process. Received: devices per process {per_process}."
            )
        return {INNER_AXIS: counts.pop()}
    if isinstance(value, Mapping):
        axes = _check_axes(value, axis)
    elif isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(
            "`devices_per_replica` must be a positive int, 'process', or a mapping of "
            "named inner axes to sizes such as {'fsdp': 4, 'tensor': 2}. Received: "
            f"devices_per_replica={value!r}."
        )
    else:
        axes = {INNER_AXIS: int(value)} if value > 1 else {}
    k, n = math.prod(axes.values()), len(devices)
    if n % k:
        raise ValueError(
            f"devices_per_replica={_show(value)} needs {k} devices per replica, which must "
            f"divide the number of devices ({n}). Valid products: "
            f"{[d for d in range(1, n + 1) if n % d == 0]}."
        )
    inside = all(c % k == 0 for c in counts)
    whole_processes = len(counts) == 1 and k % next(iter(counts)) == 0
    if not (inside or whole_processes):
        raise ValueError(
            f"devices_per_replica={_show(value)} ({k} devices per replica) must either "
            f"divide the devices of every process or be a multiple of them (devices per "
            f"process: {sorted(per_process.values())}): a replica's devices are whole "
            "processes or part of one. Use a divisor or a multiple of the devices per "
            "process."
        )
    return axes


def _check_axes(value: Mapping[Any, Any], replica_axis: str) -> dict[str, int]:
    if not value:
        raise ValueError(
            "devices_per_replica as a mapping needs at least one inner axis, e.g. "
            "{'fsdp': 4}. Received: {}."
        )
    axes: dict[str, int] = {}
    for name, size in value.items():
        if not isinstance(name, str) or not name or name == replica_axis:
            raise ValueError(
                f"devices_per_replica's axis names must be non-empty strings other than "
                f"{replica_axis!r} (the replica axis). Received: {name!r} in {dict(value)!r}."
            )
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(
                f"devices_per_replica[{name!r}] must be a positive int. Received: {size!r}."
            )
        axes[name] = int(size)
    return axes


def _show(value: Any) -> str:
    return repr(dict(value)) if isinstance(value, Mapping) else repr(value)


def replica_mesh(
    devices: Sequence[jax.Device],
    inner: Mapping[str, int],
    axis: str,
    groups: tuple[str, int] | None = None,
) -> Mesh:
    """The strategy's mesh: ``(axis,)`` with no inner axis (plain data parallelism), else
    ``(axis, *inner)``; every axis is ``Auto`` (``run`` makes ``axis`` manual).

    ``groups=(name, g)`` puts an outer axis of ``g`` groups of replicas first (DiLoCo's
    islands): ``(name, axis, *inner)``, replicas numbered group by group.
    """
    grid = np.array(devices, dtype=object)
    outer = () if groups is None else (groups[0],)
    sizes = () if groups is None else (groups[1],)
    names = (*outer, axis, *inner)
    grid = grid.reshape(*sizes, -1, *inner.values())
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def spans_processes(devices: Sequence[jax.Device], k: int) -> bool:
    """Whether replicas of ``k`` neighbouring devices cover more than one process."""
    return any(
        len({d.process_index for d in devices[i : i + k]}) > 1 for i in range(0, len(devices), k)
    )


def row_axes(
    mesh: Mesh, axis: str | tuple[str, ...], model_axes: Sequence[str] | frozenset[str]
) -> tuple[str, ...]:
    """The inner axes a replica's batch rows split over: all of them but the model axes
    (``Layout.model_axes``: tensor-parallel axes), over which the rows stay whole.

    Rows split over a tensor axis reach the first split matmul in the wrong layout: XLA
    reshards them (on ``{"fsdp": 4, "tensor": 2}`` from ``[8, 1]`` to ``[1, 4, 2]``, by
    replicating them first, and warns "Involuntary full rematerialization"; the MLP of
    docs/scaling.md moved 53 KiB per device per step in 5 all-gathers instead of 16 KiB
    in 1). Megatron-style steps want every tensor-parallel device to see its rows
    whole, and a pipeline's stages take the whole batch.

    Every inner axis when that would change which rows a process feeds: the processes
    read contiguous slices of each global batch, so rows whole over a model axis that
    spans processes (or that reorders the slices) would need the same rows on two of
    them.
    """
    axes = (axis,) if isinstance(axis, str) else axis
    inner = [a for a in mesh.axis_names if a not in axes]
    rows = tuple(a for a in inner if a not in model_axes)
    if len(rows) == len(inner) or _process_rows(mesh, axes, rows) != _process_rows(
        mesh, axes, tuple(inner)
    ):
        return tuple(inner)
    return rows


def _process_rows(mesh: Mesh, axes: tuple[str, ...], rows: tuple[str, ...]) -> dict[int, Any]:
    """Each process's share of a global batch split over ``(axis, *rows)``: the
    fractions ``(first, end)`` of the rows its devices hold, or None when not one
    contiguous block."""
    names = list(mesh.axis_names)
    sizes = [mesh.shape[a] for a in (*axes, *rows)]
    n = math.prod(sizes)
    blocks: dict[int, set[int]] = {}
    grid: Any = mesh.devices
    for idx in np.ndindex(grid.shape):
        block = np.ravel_multi_index([idx[names.index(a)] for a in (*axes, *rows)], sizes)
        blocks.setdefault(grid[idx].process_index, set()).add(int(block))
    out: dict[int, Any] = {}
    for p, held in blocks.items():
        first, end = min(held), max(held) + 1
        out[p] = (Fraction(first, n), Fraction(end, n)) if len(held) == end - first else None
    return out
