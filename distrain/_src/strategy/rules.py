"""Layout rules, one engine for state and batches: parsing, logical names, the spec check.

``layout=`` (where state leaves live inside a replica, ``layout.py``) and
``batch_layout=`` (how batch leaves are split beyond their rows, ``batch_layout.py``)
are the same kind of rule table: ``{pattern: spec}``, ``(pattern, spec)`` pairs, or (for
state) a pytree of specs with the parameters' structure. A pattern is a regular
expression searched in a leaf's path (keys joined by ``/``); a tree entry applies to the
leaves whose path ends with its path. A spec is a ``PartitionSpec`` or a tuple, its
entries mesh axes, tuples of axes, ``None``, or logical names mapped by
``logical_axis_rules`` (a mapping, flax's pairs, or an ordered MaxText table:
:class:`OrderedAxisRules`). Every rule must match a leaf and every spec must fit the
leaf it lays out: errors name the table, the entry, the leaf and what to change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, final

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from distrain._src.pytree import path_str

#: A rule table: patterns to specs (a mapping or pairs), or a pytree of specs.
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
            items.append((item[0], targets(item[1])))
        self.table: tuple[tuple[str, tuple[str, ...]], ...] = tuple(items)

    def __repr__(self) -> str:
        return f"OrderedAxisRules({list(self.table)!r})"


LogicalAxisRules = Mapping[str, Any] | Iterable[tuple[str, Any]] | OrderedAxisRules


@final
class Rule:
    """One entry of a table: a regular expression, or (from a tree) an exact path suffix."""

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


def targets(target: Any) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple: ``None`` -> ``()``, ``"a"`` -> ``("a",)``."""
    if target is None:
        return ()
    return tuple(target) if isinstance(target, tuple | list) else (target,)


def flat(entries: Iterable[Any]) -> list[str]:
    """The axis names of spec entries, in order (tuples flattened, None dropped)."""
    out: list[str] = []
    for e in entries:
        if isinstance(e, tuple):
            out.extend(e)
        elif e is not None:
            out.append(e)
    return out


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def parse(rules: LayoutRules | None, what: str) -> list[tuple[str, Any, re.Pattern[str] | None]]:
    """``(name, spec, regex or None)`` of a table: regex rules from a flat mapping or
    pairs, exact path suffixes from any other pytree of specs. ``what`` names the
    argument in errors (e.g. ``"`layout`"``)."""
    if rules is None:
        return []
    if isinstance(rules, Mapping) and all(
        isinstance(k, str) and not isinstance(v, Mapping) for k, v in rules.items()
    ):  # flat: patterns to specs (a tree of specs nests mappings)
        return [(k, v, _compile(k, what)) for k, v in rules.items()]
    if isinstance(rules, list | tuple) and all(isinstance(i, tuple) for i in rules):
        for item in rules:
            if not (len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(
                    f"{what} must map path patterns (str) to PartitionSpecs: a dict or "
                    f"(pattern, spec) pairs, or a pytree of specs. Received an item {item!r}."
                )
        return [(k, v, _compile(k, what)) for k, v in rules]
    leaves, _ = jax.tree_util.tree_flatten_with_path(rules, is_leaf=_is_spec)
    out: list[tuple[str, Any, re.Pattern[str] | None]] = []
    for path, spec in leaves:
        if not _is_spec(spec):
            raise ValueError(
                f"{what} as a pytree must have PartitionSpec leaves (or None), e.g. "
                "nnx.get_partition_spec(nnx.state(model)). Received a leaf "
                f"{spec!r} at {path_str(path)!r}."
            )
        if len(spec):  # P(): not annotated, the default applies
            out.append((path_str(path), spec, None))
    if not out and not isinstance(rules, Mapping):
        raise ValueError(
            f"{what} must be a mapping of patterns to PartitionSpecs, (pattern, spec) "
            f"pairs, or a pytree of PartitionSpecs. Received: {rules!r}."
        )
    return out


def _compile(pattern: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{what} pattern {pattern!r} is not a regular expression: {e}.") from None


@final
class Names:
    """The names specs may use: the replica's axes and the logical names mapped to them.

    One per strategy, shared by its state and batch tables, so a logical name either
    of them uses counts as used.

    Raises:
      ValueError: a logical rule to an axis the replica lacks, or (plain mappings) a
        name given twice.
    """

    def __init__(self, axes: Sequence[str], logical_axis_rules: LogicalAxisRules | None) -> None:
        self.axes = tuple(axes)
        self.ordered = isinstance(logical_axis_rules, OrderedAxisRules)
        self.logical = _logical_rules(logical_axis_rules, self.axes)
        self.used: set[str] = set()

    def translate(self, what: str, name: str, spec: Any) -> P:
        """``spec`` over mesh axes: logical names mapped, every name checked."""
        if isinstance(spec, tuple | list) and not isinstance(spec, P):
            spec = P(*spec)
        if not isinstance(spec, P):
            raise ValueError(
                f"{what} entry {name!r} must give a jax.sharding.PartitionSpec (or a tuple). "
                f"Received: {spec!r}."
            )
        entries: list[Any] = []
        for entry in spec:
            names: list[str] = []
            for n in entry if isinstance(entry, tuple) else (entry,):
                if n is None:
                    continue
                if n in self.axes:
                    names.append(n)
                elif n in self.logical:
                    self.used.add(n)
                    taken = set(flat(entries)) | set(names)
                    candidates = self.logical[n]
                    if self.ordered:  # the first that fits this spec; none: replicated
                        candidates = [c for c in candidates if not set(c) & taken][:1]
                    names.extend(candidates[0] if candidates else ())
                else:
                    hint = (
                        f" or a logical name of logical_axis_rules {sorted(self.logical)}"
                        if self.logical
                        else " (or give logical_axis_rules for logical names)"
                    )
                    raise ValueError(
                        f"{what} entry {name!r} -> {spec} names {n!r}, which is neither an "
                        f"axis of the replica {list(self.axes)}{hint}. Specs lay a leaf out "
                        "inside a replica, over its inner axes."
                    )
            if len(set(names)) != len(names) or set(names) & set(flat(entries)):
                raise ValueError(
                    f"{what} entry {name!r} -> {spec} uses an axis twice (after logical "
                    "names are mapped): each axis may split one dimension."
                )
            entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
        return P(*entries)

    def check_all_used(self) -> None:
        """Raises if a plain mapping names logical names no spec used."""
        unused = sorted(set(self.logical) - self.used)
        if unused and not self.ordered:
            raise ValueError(
                f"logical_axis_rules names {unused}, which no layout spec uses. "
                f"Remove them, or use them in a spec. Logical names in use: {sorted(self.used)}."
            )


def check_fits(
    what: str, name: str, spec: P, mesh: Mesh, path: str, shape: tuple[int, ...], first: int = 0
) -> None:
    """The one spec check: ``spec`` has at most one entry per dimension of the leaf at
    ``path`` and its axes divide each dimension from ``first`` on.

    Raises:
      ValueError: naming the table, the entry, the leaf, its shape and what to change.
    """
    if len(spec) > len(shape):
        raise ValueError(
            f"{what} entry {name!r} -> {spec} has {len(spec)} entries, but the leaf {path!r} "
            f"has shape {shape} ({len(shape)} dimensions): it names a dimension that does not "
            "exist. Give one entry per dimension at most, or make the pattern match fewer "
            "leaves."
        )
    for dim in range(first, len(spec)):
        size = math.prod(mesh.shape[a] for a in flat([spec[dim]]))
        if shape[dim] % size:
            raise ValueError(
                f"{what} entry {name!r} -> {spec} splits dimension {dim} of the leaf {path!r} "
                f"(shape {shape}) over {size} devices ({spec[dim]!r}), but {shape[dim]} is "
                f"not divisible by {size}. Use a length that is a multiple of {size}, split "
                "another dimension, or leave it None."
            )


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
        for name, candidate in rules.table:
            fits = all(t in axes for t in candidate)
            ordered.setdefault(name, []).extend([candidate] if fits else [])
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
        bad = [t for t in targets(target) if t not in axes]
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
        out[name] = [targets(target)]
    return out
