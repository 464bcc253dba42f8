"""Moved: the LM example's model is distrain's GPT-2 family, ``distrain.models``.

Every name this module had (``transformer``, ``LMConfig``, ``Transformer``, ...) still
works here for a release, with a ``DeprecationWarning`` naming its new place; configs
that say ``model.fn: examples.lm.model:transformer`` keep working the same way. Use
``distrain.models:transformer``.
"""

from __future__ import annotations

import warnings
from typing import Any

import distrain.models as _models


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name not in _models.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"examples.lm.model.{name} moved to distrain.models.{name} (dt.models.{name}); the "
        "old path will be removed in distrain 0.3 (see CHANGELOG.md).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_models, name)
