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
from collections.abc import Sequence
from typing import Any, final

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distrain._src.strategy.rules import LayoutRules, Names, Rule, check_fits, flat, parse

_WHAT = "`batch_layout`"


@final
class BatchLayout:
    """Per-leaf batch specs of one strategy (the rule engine of ``rules.py``).

    Args:
      mesh: the strategy's mesh ``("replica", *inner)``.
      replica_axis: its replica axis (or axes, group axis first: DiLoCo's islands).
      rules: ``{path pattern: spec}`` or ``(pattern, spec)`` pairs; specs are
        PartitionSpecs or tuples, their entries inner axes, tuples of axes or logical
        names.
      row_axes: the inner axes rows split over (default: all of them; the strategy
        leaves out its model axes, ``replica_mesh.row_axes``).
      names: the names specs may use (the strategy's, shared with its state layout);
        default: the inner axes, no logical names.

    Raises:
      ValueError: a pattern that is not a regular expression, a spec that is not a
        PartitionSpec or tuple, whose first entry is not None, or that names an axis
        the replica lacks.
    """

    def __init__(
        self,
        mesh: Mesh,
        replica_axis: str | tuple[str, ...],
        rules: LayoutRules,
        *,
        row_axes: Sequence[str] | None = None,
        names: Names | None = None,
    ) -> None:
        self._mesh = mesh
        self._replica = (replica_axis,) if isinstance(replica_axis, str) else tuple(replica_axis)
        self._replicas = math.prod(mesh.shape[a] for a in self._replica)
        self._inner = [a for a in mesh.axis_names if a not in self._replica]
        self._row_axes = list(self._inner if row_axes is None else row_axes)
        names = names if names is not None else Names(self._inner, None)
        self._rules = [
            Rule(name, self._check(name, names.translate(_WHAT, name, spec)), regex=regex)
            for name, spec, regex in parse(rules, _WHAT)
        ]

    def _check(self, pattern: str, spec: P) -> P:
        if not len(spec) or spec[0] is not None:
            raise ValueError(
                f"{_WHAT} entry {pattern!r} -> {spec}: the first entry stands for the rows, "
                "which the strategy splits; make it None, e.g. P(None, 'context')."
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
            rule = next((r for r in self._rules if r.matches(path)), None)
            if rule is None:
                out.append(base)
                continue
            used.add(rule.name)
            out.append(NamedSharding(self._mesh, self._spec(rule, path, shape, rows)))
        unused = [r.name for r in self._rules if r.name not in used]
        if unused:
            raise ValueError(
                f"{_WHAT} entries {unused} match no leaf of the batch (its leaves: "
                f"{list(paths)}). Fix the pattern, or remove the entry."
            )
        return out

    def spec_inside(self, path: str, shape: tuple[int, ...]) -> P | None:
        """The spec of leaf ``path`` (of ``shape``) as a replica sees it, inside its step:
        rows over the inner axes the rule leaves free (when they divide), or None
        without a rule."""
        for rule in self._rules:
            if rule.matches(path):
                rows = self._spec(rule, path, shape, shape[0] * self._replicas)[0]
                rows = rows if isinstance(rows, tuple) else (rows,)
                free = rows[len(self._replica) :]  # the replica axes first
                return P(free or None, *rule.spec[1:])
        return None

    def _spec(self, rule: Rule, path: str, shape: tuple[int, ...], rows: int) -> P:
        spec = rule.spec
        check_fits(_WHAT, rule.name, spec, self._mesh, path, shape, first=1)  # rows: below
        named = set(flat(spec[1:]))
        free = tuple(a for a in self._row_axes if a not in named)
        k = math.prod(self._mesh.shape[a] for a in free)
        row_axes = (*self._replica, *free) if (rows // self._replicas) % k == 0 else self._replica
        return P(row_axes[0] if len(row_axes) == 1 else row_axes, *spec[1:])
