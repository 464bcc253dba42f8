"""Pytree types and a key path as text, one way for the whole package.

Layout rules match these strings, checkpoints record them, messages print them.

Example:
  >>> path_str(jax.tree_util.tree_flatten_with_path({"params": {"w": 1}})[0][0][0])
  'params/w'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

# A pytree (nested dicts, lists, tuples, dataclasses, flax/optax states, ...) of arrays.
PyTree = Any
# What tree_flatten_with_path gives each leaf: its keys from the root.
KeyPath = tuple[Any, ...]


def path_str(path: Sequence[Any]) -> str:
    """``"params/dense/kernel"``: jax's simple ``keystr`` joined by ``/`` (dict keys,
    attribute names and sequence indices as they are; ``""`` for the root)."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")
