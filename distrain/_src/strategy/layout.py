"""Where state lives on a replica's devices: layout rules, logical names, FSDP.

A replica is a small named mesh (``replica_mesh.py``). Each state leaf gets a
``PartitionSpec`` over the replica's inner axes (:class:`Layout`):

* **rules** (tensor parallelism, 2-D layouts): ``{pattern: PartitionSpec}`` or
  ``(pattern, spec)`` pairs; the first pattern that ``re.search``-es a leaf's path
  (``"params/dense/kernel"``, keys joined by ``/``) gives its spec, e.g.
  ``P(None, "tensor")`` to split a kernel's columns, ``P("fsdp", "tensor")`` for both,
  ``P(("fsdp", "tensor"), None)`` for one dimension over two axes. Optimizer moments
  have their parameter's path as a suffix (``"opt_state/0/mu/dense/kernel"``), so an
  unanchored pattern lays them out like their parameter;
* **a tree of specs** with the parameters' structure (flax's
  ``nnx.get_partition_spec(nnx.state(model))``): each spec applies to the state leaves
  whose path ends with its path (the parameter and its moments); an empty ``P()`` there
  means "not annotated" (the FSDP default applies);
* **logical names**: a spec may name logical axes (``P("embed", "mlp")``) that
  ``logical_axis_rules={"embed": "fsdp", "mlp": "tensor", "batch": None}`` maps to mesh
  axes (flax's logical naming);
* **FSDP** (every other leaf): a leaf of at least ``min_shard_bytes`` (counted at 4 bytes
  per element, so a bfloat16 parameter and its float32 moments agree) is split over the
  FSDP axis (``"fsdp"`` when the replica has one, else its first inner axis) along its
  largest dimension divisible by that axis's size (the first on ties); smaller or
  indivisible leaves are replicated inside the replica. The largest dimension, not the
  leading one: on the MLP 512-2048-10 over 8 devices the compiled step's peak was 0.13x
  mirrored with it and 0.45x with the leading one (``benchmarks/replica_spans.py``).

Every rule, tree entry and logical name must be used: one that matches no leaf of the
state placed with ``put_replicated`` is an error, as are names the mesh lacks and splits
that do not divide a dimension (a layout that silently matches nothing leaves a model
replicated until it runs out of memory).

``shard_state`` (one replica per device, state split across replicas *between* steps
only) is the same FSDP rule over the replica axis: a :class:`Layout` over ``"replica"``
(or, for ``"process"``, over the devices of each process).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, final

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distrain._src.pytree import path_str as path_str

FSDP_AXIS = "fsdp"

LayoutRules = Mapping[str, Any] | Iterable[tuple[str, Any]] | Any


@final
class OrderedAxisRules:
    """An ordered ``logical_axis_rules`` table as MaxText and flax write them.

    ``(logical name, mesh axis | tuple of axes | None)`` pairs in priority order; a name
    may appear several times. For each dimension of a spec, the first candidate of its
    name wins whose axes the replica has and no other dimension of the same spec uses;
    a name none of whose candidates fits is replicated. So a table written for a larger
    mesh (``"data"``, ``"expert"``, ...) pastes as is. Unlike a plain mapping, names no
    spec uses are not an error (a pasted table names more than one model uses); layout
    rules that match no leaf still are.

    Example:
      >>> rules = dt.OrderedAxisRules([("embed", "fsdp"), ("mlp", "tensor"),
      ...                              ("mlp", "fsdp"), ("batch", "data")])
      >>> dt.MirroredStrategy(devices_per_replica={"fsdp": 4, "tensor": 2},
      ...                     layout={"mlp/up/kernel": P("embed", "mlp")},
      ...                     logical_axis_rules=rules)

    Raises:
      ValueError: an item that is not a ``(str, axis | tuple | None)`` pair.
    """

    def __init__(self, table: Iterable[tuple[str, Any]]) -> None:
        items = []
        for item in table:
            if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(
                    "OrderedAxisRules takes (logical name, mesh axis | tuple of axes | None) "
                    f"pairs. Received an item {item!r}."
                )
            items.append((item[0], _targets(item[1])))
        self.table: tuple[tuple[str, tuple[str, ...]], ...] = tuple(items)

    def __repr__(self) -> str:
        return f"OrderedAxisRules({list(self.table)!r})"


LogicalAxisRules = Mapping[str, Any] | Iterable[tuple[str, Any]] | OrderedAxisRules


def _targets(target: Any) -> tuple[str, ...]:
    if target is None:
        return ()
    return tuple(target) if isinstance(target, tuple | list) else (target,)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


class _Rule:
    """One layout entry: a regular expression, or (from a tree) an exact path suffix."""

    __slots__ = ("name", "regex", "suffix", "spec")

    def __init__(self, name: str, spec: P, *, regex: re.Pattern[str] | None) -> None:
        self.name, self.spec, self.regex = name, spec, regex
        self.suffix = None if regex is not None else _strip_value(name)

    def matches(self, path: str) -> bool:
        if self.regex is not None:
            return bool(path) and self.regex.search(path) is not None
        p, suffix = _strip_value(path), self.suffix or ""
        return p == suffix or p.endswith("/" + suffix)


def _strip_value(path: str) -> str:
    # flax NNX states end a parameter's path with its ".value" attribute; pure dicts do not.
    return path[: -len("/value")] if path.endswith("/value") else path


@final
class Layout:
    """Where each state leaf lives inside a replica (module docstring).

    Args:
      mesh: the mesh the state lives on.
      fsdp_axis: the axis leaves without a rule are split over.
      rules: regex rules (``{pattern: spec}`` or pairs), or a pytree of specs.
      min_shard_bytes: FSDP leaves below this size stay whole.
      axes: the axes specs may name (default: ``(fsdp_axis,)``).
      logical_axis_rules: ``{logical name: mesh axis, tuple of axes, or None}``.

    Raises:
      ValueError: a pattern that is not a regular expression, a spec naming an axis the
        replica lacks or a logical name without a rule, a logical rule to an unknown axis.
    """

    def __init__(
        self,
        mesh: Mesh,
        fsdp_axis: str,
        rules: LayoutRules | None,
        min_shard_bytes: int,
        *,
        axes: Sequence[str] | None = None,
        logical_axis_rules: LogicalAxisRules | None = None,
    ) -> None:
        self.k = mesh.shape[fsdp_axis]
        self.axis = fsdp_axis
        self.min_shard_bytes = min_shard_bytes
        self._mesh = mesh
        self._axes = tuple(axes) if axes is not None else (fsdp_axis,)
        self._ordered = isinstance(logical_axis_rules, OrderedAxisRules)
        self._logical = _logical_rules(logical_axis_rules, self._axes)
        self._logical_used: set[str] = set()
        self._rules = [
            _Rule(name, self._translate(name, spec), regex=regex)
            for name, spec, regex in _entries(rules)
        ]

    @property
    def has_rules(self) -> bool:
        return bool(self._rules)

    @property
    def model_axes(self) -> frozenset[str]:
        """The axes that rules split weights over, the FSDP axis and ``"stage"`` aside:
        tensor-parallel axes, whose devices compute different parts of the same rows
        (the strategy keeps a batch's rows whole over them).

        ``"stage"`` keeps the rows split over it, as before this distinction: rows whole
        over it made XLA abort while compiling the LM's pipeline on
        ``{"stage": 2, "fsdp": 2}`` (tests/test_example_lm.py, jax 0.10.2), and
        ``dt.nn.pipeline`` gathers its microbatches itself. ``"expert"`` too: its devices
        hold different experts, and ``dt.nn.moe`` sends each token to its experts.
        """
        return frozenset(a for r in self._rules for a in _flat(r.spec)) - {
            self.axis,
            "stage",
            "expert",
        }

    def sharding(self, shape: tuple[int, ...], path: str = "") -> NamedSharding:
        """The sharding of a state leaf of ``shape`` at ``path``.

        Raises:
          ValueError: a rule's spec has more entries than the leaf has dimensions, or
            splits a dimension not divisible by its axes' size (the message names both).
        """
        for rule in self._rules:
            if rule.matches(path):
                return NamedSharding(self._mesh, self._fit(rule, shape, path))
        return NamedSharding(self._mesh, self._fsdp(shape))

    def check_all_used(self, paths: Sequence[str]) -> None:
        """Raises unless every rule matched a leaf (of ``paths``, the placed tree's) and
        every logical rule was used by a spec."""
        unused = [r.name for r in self._rules if not any(r.matches(p) for p in paths)]
        if unused:
            shown = ", ".join(repr(p) for p in paths[:8]) + (", ..." if len(paths) > 8 else "")
            raise ValueError(
                f"Layout entries {unused} match no leaf of the state being placed (its "
                f"paths: {shown}). Every layout rule must lay out something: fix the "
                "pattern or path, remove the entry, or place the whole state in one "
                "put_replicated call."
            )
        unused_logical = sorted(set(self._logical) - self._logical_used)
        if unused_logical and not self._ordered:
            raise ValueError(
                f"logical_axis_rules names {unused_logical}, which no layout spec uses. "
                f"Remove them, or use them in a spec. Logical names in use: "
                f"{sorted(self._logical_used)}."
            )

    def _translate(self, name: str, spec: Any) -> P:
        """``spec`` over mesh axes: logical names mapped, every name checked."""
        if isinstance(spec, tuple | list) and not isinstance(spec, P):
            spec = P(*spec)
        if not isinstance(spec, P):
            raise ValueError(
                f"Layout entry {name!r} must give a jax.sharding.PartitionSpec (or a tuple). "
                f"Received: {spec!r}."
            )
        entries: list[Any] = []
        for entry in spec:
            names: list[str] = []
            for n in entry if isinstance(entry, tuple) else (entry,):
                if n is None:
                    continue
                if n in self._axes:
                    names.append(n)
                elif n in self._logical:
                    self._logical_used.add(n)
                    used = set(_flat(entries)) | set(names)
                    candidates = self._logical[n]
                    if self._ordered:  # the first that fits this spec; none: replicated
                        free = [c for c in candidates if not set(c) & used]
                        candidates = free[:1]
                    names.extend(candidates[0] if candidates else ())
                else:
                    hint = (
                        f" or a logical name of logical_axis_rules {sorted(self._logical)}"
                        if self._logical
                        else " (or give logical_axis_rules for logical names)"
                    )
                    raise ValueError(
                        f"Layout entry {name!r} -> {spec} names {n!r}, which is neither an "
                        f"axis of the replica {list(self._axes)}{hint}. Specs lay a leaf out "
                        "inside a replica, over its inner axes."
                    )
            if len(set(names)) != len(names) or set(names) & set(_flat(entries)):
                raise ValueError(
                    f"Layout entry {name!r} -> {spec} uses an axis twice (after logical "
                    "names are mapped): each axis may split one dimension."
                )
            entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
        return P(*entries)

    def _fsdp(self, shape: tuple[int, ...]) -> P:
        if self.k == 1 or 4 * math.prod(shape) < self.min_shard_bytes:
            return P()
        divisible = [i for i, d in enumerate(shape) if d % self.k == 0 and d >= self.k]
        if not divisible:
            return P()
        dim = max(divisible, key=lambda i: (shape[i], -i))  # largest, first on ties
        return P(*([None] * dim), self.axis)

    def _fit(self, rule: _Rule, shape: tuple[int, ...], path: str) -> P:
        spec = rule.spec
        if len(spec) > len(shape):
            raise ValueError(
                f"Layout entry {rule.name!r} -> {spec} has {len(spec)} entries, but the leaf "
                f"{path!r} has shape {shape} ({len(shape)} dimensions). Give one entry per "
                "dimension at most, or make the pattern match fewer leaves."
            )
        for dim, entry in enumerate(spec):
            size = math.prod(self._mesh.shape[a] for a in _flat([entry]))
            if shape[dim] % size:
                raise ValueError(
                    f"Layout entry {rule.name!r} -> {spec} splits dimension {dim} of {path!r} "
                    f"(shape {shape}) over {size} devices ({entry!r}), but {shape[dim]} is "
                    f"not divisible by {size}. Split another dimension or leave it None."
                )
        return spec


def _flat(entries: Iterable[Any]) -> list[str]:
    out: list[str] = []
    for e in entries:
        if isinstance(e, tuple):
            out.extend(e)
        elif e is not None:
            out.append(e)
    return out


def _entries(rules: LayoutRules | None) -> list[tuple[str, Any, re.Pattern[str] | None]]:
    """``(name, spec, regex or None)``: regex rules from a flat mapping or pairs, exact
    path suffixes from any other pytree of specs."""
    if rules is None:
        return []
    if isinstance(rules, Mapping) and all(
        isinstance(k, str) and not isinstance(v, Mapping) for k, v in rules.items()
    ):  # flat: patterns to specs (a tree of specs nests mappings)
        return [(k, v, _compile(k)) for k, v in rules.items()]
    if isinstance(rules, list | tuple) and all(isinstance(i, tuple) for i in rules):
        for item in rules:
            if not (len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(
                    "`layout` must map path patterns (str) to PartitionSpecs: a dict or "
                    f"(pattern, spec) pairs, or a pytree of specs. Received an item {item!r}."
                )
        return [(k, v, _compile(k)) for k, v in rules]
    flat, _ = jax.tree_util.tree_flatten_with_path(rules, is_leaf=_is_spec)
    out: list[tuple[str, Any, re.Pattern[str] | None]] = []
    for path, spec in flat:
        if not _is_spec(spec):
            raise ValueError(
                "`layout` as a pytree must have PartitionSpec leaves (or None), e.g. "
                "nnx.get_partition_spec(nnx.state(model)). Received a leaf "
                f"{spec!r} at {path_str(path)!r}."
            )
        if len(spec):  # P(): not annotated, the default applies
            out.append((path_str(path), spec, None))
    if not out and not isinstance(rules, Mapping):
        raise ValueError(
            f"`layout` must be a mapping of patterns to PartitionSpecs, (pattern, spec) "
            f"pairs, or a pytree of PartitionSpecs. Received: {rules!r}."
        )
    return out


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"Layout pattern {pattern!r} is not a regular expression: {e}.") from None


def _logical_rules(
    rules: LogicalAxisRules | None, axes: Sequence[str]
) -> dict[str, list[tuple[str, ...]]]:
    """``{logical name: candidate mesh axes}``: one candidate from a mapping or flax's
    ``(name, axis)`` pairs; for an :class:`OrderedAxisRules`, the candidates the
    replica has, in order."""
    if rules is None:
        return {}
    if isinstance(rules, OrderedAxisRules):
        ordered: dict[str, list[tuple[str, ...]]] = {}
        for name, targets in rules.table:
            fits = all(t in axes for t in targets)
            ordered.setdefault(name, []).extend([targets] if fits else [])
        return ordered
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    out: dict[str, list[tuple[str, ...]]] = {}
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(
                "`logical_axis_rules` must map logical names (str) to a mesh axis, a tuple "
                f"of axes or None. Received an item {item!r}."
            )
        name, target = item
        targets = _targets(target)
        bad = [t for t in targets if t not in axes]
        if bad:
            raise ValueError(
                f"logical_axis_rules maps {name!r} to {bad}, which the replica lacks: its "
                f"inner axes are {list(axes)}. Map it to one of them, or to None (replicated)."
            )
        if name in out:
            raise ValueError(
                f"logical_axis_rules names {name!r} twice; give one rule per name (or pass "
                "an ordered table with several candidates per name: dt.OrderedAxisRules)."
            )
        out[name] = [targets]
    return out
