"""How a batch's leaves are laid out inside a replica beyond its rows: ``batch_layout``.

By default replica ``i``'s rows are split over all of its devices. A batch layout
splits other dimensions of chosen leaves over inner axes instead, e.g. the sequence
over ``"context"``::

    dt.MirroredStrategy(devices_per_replica={"fsdp": 2, "context": 4},
                        batch_layout={"tokens|targets|positions|segment_ids": P(None, "context")})

Keys are regular expressions searched in a leaf's path (``"tokens"``, ``"inputs/ids"``);
a spec's first entry stands for the rows and must be ``None`` (the strategy splits the
rows: over the replicas and the inner axes the spec does not use, model axes such as
``"tensor"`` aside), the others name
inner axes. It is part of the replica's layout, like ``layout``, so every input path
follows it: batches from the host, datasets kept on the devices (a constraint inside
the step), and abstract batches for ``memory_analysis``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, final

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@final
class BatchLayout:
    """Per-leaf batch specs of one strategy.

    Args:
      mesh: the strategy's mesh ``("replica", *inner)``.
      replica_axis: its replica axis (or axes, group axis first: DiLoCo's islands).
      rules: ``{path pattern: PartitionSpec}``.
      row_axes: the inner axes rows split over (default: all of them; the strategy
        leaves out its model axes, ``replica_mesh.row_axes``).

    Raises:
      ValueError: a pattern that is not a regular expression, a spec that is not a
        PartitionSpec, whose first entry is not None, or that names an axis the
        replica lacks.
    """

    def __init__(
        self,
        mesh: Mesh,
        replica_axis: str | tuple[str, ...],
        rules: Mapping[str, Any],
        *,
        row_axes: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(rules, Mapping):
            raise ValueError(
                "`batch_layout` must map leaf path patterns to PartitionSpecs, e.g. "
                f"{{'tokens': P(None, 'context')}}. Received: {rules!r}."
            )
        self._mesh = mesh
        self._replica = (replica_axis,) if isinstance(replica_axis, str) else tuple(replica_axis)
        self._replicas = math.prod(mesh.shape[a] for a in self._replica)
        self._inner = [a for a in mesh.axis_names if a not in self._replica]
        self._row_axes = list(self._inner if row_axes is None else row_axes)
        self._rules = [(_compile(k), k, self._check(k, v)) for k, v in rules.items()]

    def _check(self, pattern: str, spec: Any) -> P:
        if not isinstance(spec, P):
            raise ValueError(
                f"batch_layout[{pattern!r}] must be a jax.sharding.PartitionSpec. "
                f"Received: {spec!r}."
            )
        if not len(spec) or spec[0] is not None:
            raise ValueError(
                f"batch_layout[{pattern!r}] -> {spec}: the first entry stands for the rows, "
                "which the strategy splits; make it None, e.g. P(None, 'context')."
            )
        for entry in spec[1:]:
            for name in entry if isinstance(entry, tuple) else (entry,):
                if name is not None and name not in self._inner:
                    raise ValueError(
                        f"batch_layout[{pattern!r}] -> {spec} names {name!r}, which is not an "
                        f"inner axis of the replica {self._inner}."
                    )
        return spec

    def shardings(
        self, paths: Sequence[str], shapes: Sequence[tuple[int, ...]], rows: int, base: Any
    ) -> list[Any]:
        """One sharding per leaf: ``base`` (rows only) or the matching rule's.

        Raises:
          ValueError: a rule that matches no leaf of the batch, a spec with more entries
            than its leaf has dimensions or one whose axes do not divide its dimension.
        """
        used: set[str] = set()
        out = []
        for path, shape in zip(paths, shapes, strict=True):
            rule = next(((p, s) for rx, p, s in self._rules if rx.search(path)), None)
            if rule is None:
                out.append(base)
                continue
            used.add(rule[0])
            out.append(NamedSharding(self._mesh, self._spec(rule[0], rule[1], path, shape, rows)))
        unused = [p for _, p, _ in self._rules if p not in used]
        if unused:
            raise ValueError(
                f"batch_layout entries {unused} match no leaf of the batch (its leaves: "
                f"{list(paths)}). Fix the pattern, or remove the entry."
            )
        return out

    def spec_inside(self, path: str, shape: tuple[int, ...]) -> P | None:
        """The spec of leaf ``path`` (of ``shape``) as a replica sees it, inside its step:
        rows over the inner axes the rule leaves free (when they divide), or None
        without a rule."""
        for rx, pattern, spec in self._rules:
            if rx.search(path):
                rows = self._spec(pattern, spec, path, shape, shape[0] * self._replicas)[0]
                rows = rows if isinstance(rows, tuple) else (rows,)
                free = rows[len(self._replica) :]  # the replica axes first
                return P(free or None, *spec[1:])
        return None

    def _free(self, spec: P) -> tuple[str, ...]:
        named = {n for e in spec[1:] for n in (e if isinstance(e, tuple) else (e,))}
        return tuple(a for a in self._row_axes if a not in named)

    def _spec(self, pattern: str, spec: P, path: str, shape: tuple[int, ...], rows: int) -> P:
        if len(spec) > len(shape):
            raise ValueError(
                f"batch_layout[{pattern!r}] -> {spec} has {len(spec)} entries, but the batch "
                f"leaf {path!r} has shape {shape} ({len(shape)} dimensions): it names a "
                "dimension that does not exist."
            )
        for dim, entry in enumerate(spec[1:], start=1):
            names = entry if isinstance(entry, tuple) else (entry,)
            size = math.prod(self._mesh.shape[n] for n in names if n is not None)
            if shape[dim] % size:
                raise ValueError(
                    f"batch_layout[{pattern!r}] -> {spec} splits dimension {dim} of the batch "
                    f"leaf {path!r} (shape {shape}) over {size} devices, but {shape[dim]} is "
                    f"not divisible by {size}. Use a length that is a multiple of {size}."
                )
        free = self._free(spec)
        k = math.prod(self._mesh.shape[a] for a in free)
        row_axes = (*self._replica, *free) if (rows // self._replicas) % k == 0 else self._replica
        return P(row_axes[0] if len(row_axes) == 1 else row_axes, *spec[1:])


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(
            f"batch_layout pattern {pattern!r} is not a regular expression: {e}."
        ) from None
