"""DiLoCo's configuration, its fragments and when each of them syncs.

The semantics are those torchft's Streaming DiLoCo regression fixtures encode
(``torchft/diloco_regression_test.py``), with steps counted from 1 (step ``s`` is the
``s``-th inner step, and "after step ``s``" is when ``s`` inner steps are done):

* the parameters are split in ``F`` fragments, contiguous groups of leaves in pytree
  order (``fragments=F``) or the leaves whose path matches each of a list of patterns;
* fragment ``f`` (0-based) syncs after the steps ``s`` with
  ``s ≡ (f + 1) · H / F (mod H)``, ``H = sync_every``: with ``H = 6, F = 2`` fragment 0
  after steps 3, 9, 15, ... and fragment 1 after 6, 12, ...; plain DiLoCo is ``F = 1``;
* with ``fragment_sync_delay = d`` the fragment's pseudo-gradient is taken from the
  local parameters after step ``s - d`` and applied after step ``s``; ``d < H / F``, so
  at most one fragment is in flight. Here that is a delayed application: the exchange
  runs inside step ``s - d`` (``outer.py``), and the ``d`` steps do not overlap it;
* ``fragment_update_alpha = α``: after a sync, local ← α·local + (1 − α)·global, where
  local is the island's parameters after step ``s`` (α = 0: the islands take the
  global parameters bit for bit; α = 1: they keep theirs).
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from distrain._src.islands.codecs import OuterDType, outer_dtype_name
from distrain._src.pytree import path_str


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """What an outer step does and when; validated on construction.

    Attributes:
      sync_every: ``H``, the inner steps of a round (each fragment syncs once a round).
      outer_optimizer: the optax transformation applied to the global parameters with
        the pseudo-gradient as gradient, e.g. ``optax.sgd(0.7, momentum=0.9,
        nesterov=True)`` (DiLoCo's). Each fragment has its own state of it.
      fragments: ``F``, an int (contiguous groups of leaves in pytree order, sizes as
        even as ``np.array_split`` makes them) or a sequence of regular expressions:
        fragment ``i`` holds the leaves whose path (``"dense/kernel"``) the ``i``-th
        pattern is the first to ``re.search``.
      fragment_sync_delay: ``d``, the inner steps between a fragment's exchange and
        the application of its result (Streaming DiLoCo's overlap window; here the
        exchange runs synchronously in the first of them, see ``outer.py``).
      fragment_update_alpha: ``α`` in [0, 1], the weight of the local copy in the merge.
      outer_dtype: the codec of the outer gradients each island sends: ``"float32"``
        (or None), ``"bfloat16"``, ``"int8"`` or ``"int4"`` (see ``codecs.py``).

    Raises:
      ValueError: ``sync_every < 1``; ``fragments < 1`` or an empty list; ``sync_every``
        not divisible by the number of fragments; ``fragment_sync_delay`` negative or
        ``>= sync_every / fragments``; ``fragment_update_alpha`` outside [0, 1]; a
        pattern that is not a regular expression; an unknown ``outer_dtype``.
      TypeError: ``outer_optimizer`` is not an ``optax.GradientTransformation``;
        ``fragments`` is neither an int nor a sequence of strings.

    Example:
      >>> config = DiLoCoConfig(sync_every=6, outer_optimizer=optax.sgd(0.7, momentum=0.9,
      ...     nesterov=True), fragments=2, fragment_sync_delay=1)
      >>> config.sync_positions, config.snapshot_positions     # steps mod H
      ((3, 0), (2, 5))
    """

    sync_every: int
    outer_optimizer: optax.GradientTransformation
    fragments: int | tuple[str, ...] = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    outer_dtype: OuterDType = "float32"

    def __post_init__(self) -> None:
        h = self.sync_every
        if not _is_int(h) or h < 1:
            raise ValueError(
                "sync_every (H, the inner steps of a round) must be an int >= 1. "
                f"Received: sync_every={h!r}."
            )
        if not isinstance(self.outer_optimizer, optax.GradientTransformation):
            hint = (
                " It is a function: call it, e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)."
                if callable(self.outer_optimizer)
                else ""
            )
            raise TypeError(
                "outer_optimizer must be an optax.GradientTransformation, e.g. "
                "optax.sgd(0.7, momentum=0.9, nesterov=True). Received: "
                f"{self.outer_optimizer!r} of type {type(self.outer_optimizer).__name__}.{hint}"
            )
        object.__setattr__(self, "fragments", _check_fragments(self.fragments))
        f = self.num_fragments
        if h % f:
            divisors = [n for n in range(1, h + 1) if h % n == 0]
            raise ValueError(
                f"sync_every ({h}) must be divisible by the number of fragments ({f}): "
                f"fragment f syncs after step (f + 1) * sync_every / fragments of each round. "
                f"Use a sync_every that is a multiple of {f}, or a number of fragments "
                f"among {divisors}."
            )
        d = self.fragment_sync_delay
        period = h // f
        if not _is_int(d) or not 0 <= d < period:
            raise ValueError(
                f"fragment_sync_delay must be an int in [0, sync_every / fragments) = "
                f"[0, {period}): a fragment's exchange must end before the next fragment "
                f"starts its own. Received: fragment_sync_delay={d!r} with sync_every={h} "
                f"and {f} fragment(s). Use a delay of at most {period - 1}, or fewer "
                "fragments."
            )
        alpha = self.fragment_update_alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, numbers.Real)
            or not 0.0 <= float(alpha) <= 1.0
        ):
            raise ValueError(
                "fragment_update_alpha must be a number in [0, 1], the weight of the local "
                "parameters in local <- alpha * local + (1 - alpha) * global (0: the "
                f"islands take the global parameters). Received: {alpha!r}."
            )
        object.__setattr__(self, "fragment_update_alpha", float(alpha))
        object.__setattr__(self, "outer_dtype", outer_dtype_name(self.outer_dtype))

    @property
    def num_fragments(self) -> int:
        """``F``."""
        return self.fragments if isinstance(self.fragments, int) else len(self.fragments)

    @property
    def sync_positions(self) -> tuple[int, ...]:
        """Per fragment, the inner step count mod ``H`` after which it syncs."""
        period = self.sync_every // self.num_fragments
        return tuple(((f + 1) * period) % self.sync_every for f in range(self.num_fragments))

    @property
    def snapshot_positions(self) -> tuple[int, ...]:
        """Per fragment, the step count mod ``H`` whose parameters its sync sends."""
        d = self.fragment_sync_delay
        return tuple((p - d) % self.sync_every for p in self.sync_positions)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_fragments(fragments: Any) -> int | tuple[str, ...]:
    if _is_int(fragments):
        if fragments < 1:
            raise ValueError(
                "fragments must be >= 1 (1: plain DiLoCo, the whole model syncs at once). "
                f"Received: fragments={fragments!r}."
            )
        return int(fragments)
    if isinstance(fragments, str) or not isinstance(fragments, Sequence):
        raise TypeError(
            "fragments must be an int (contiguous groups of leaves) or a list of regular "
            f"expressions over parameter paths, e.g. [r'^embed', r'.*']. Received: "
            f"{fragments!r}."
        )
    patterns = tuple(fragments)
    if not patterns:
        raise ValueError(
            "fragments as a list needs at least one pattern, e.g. ['.*']. Received: []."
        )
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(
                f"fragments must be a list of strings (regular expressions). Received an "
                f"item {pattern!r} of type {type(pattern).__name__} in {list(patterns)!r}."
            )
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"Fragment pattern {pattern!r} is not a regular expression: {e}."
            ) from None
    return patterns


def leaf_paths(params: Any) -> list[str]:
    """The paths of ``params``' leaves as fragment patterns see them (``"dense/kernel"``)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [path_str(path) for path, _ in flat]


def fragment_ids(config: DiLoCoConfig, params: Any) -> tuple[int, ...]:
    """The fragment of each leaf of ``params``, in ``jax.tree.leaves`` order.

    Static: it depends on the tree structure only, so it is computed at trace time.

    Raises:
      ValueError: more fragments than leaves; with patterns, a leaf that no pattern
        matches or a pattern that matches no leaf.

    Example:
      >>> params = {"a": 0.0, "b": 0.0, "c": 0.0}
      >>> fragment_ids(DiLoCoConfig(2, optax.sgd(1.0), fragments=2), params)
      (0, 0, 1)
      >>> fragment_ids(DiLoCoConfig(2, optax.sgd(1.0), fragments=["b", ".*"]), params)
      (1, 0, 1)
    """
    paths = leaf_paths(params)
    f = config.num_fragments
    if f > len(paths):
        raise ValueError(
            f"fragments={f} splits the parameters in {f} fragments, but they have "
            f"{len(paths)} leaves ({paths}). Use at most {len(paths)} fragments."
        )
    if isinstance(config.fragments, int):
        groups = np.array_split(np.arange(len(paths)), f)
        return tuple(i for i, group in enumerate(groups) for _ in group)
    ids: list[int] = []
    unmatched = []
    for path in paths:
        match = next(
            (i for i, pattern in enumerate(config.fragments) if re.search(pattern, path)),
            None,
        )
        if match is None:
            unmatched.append(path)
        ids.append(-1 if match is None else match)
    if unmatched:
        raise ValueError(
            f"Every parameter must belong to a fragment; no pattern of "
            f"{list(config.fragments)} matches {unmatched}. Add a pattern for them, e.g. "
            "'.*' last to catch the rest."
        )
    unused = [p for i, p in enumerate(config.fragments) if i not in ids]
    if unused:
        raise ValueError(
            f"Fragment patterns {unused} match no parameter (an earlier pattern may take "
            f"every leaf they match); the parameter paths are {paths}. Remove them or "
            "make them match."
        )
    return tuple(ids)
