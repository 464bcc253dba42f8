"""Argument checks shared by the public API, with one message template.

Every positive-count argument (steps, intervals, pack counts) is checked here so a
user sees the same sentence whichever class they misconfigured::

    `save_interval_steps` must be a positive int. Received: save_interval_steps=0.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_positive_int(value: Any) -> bool:
    """An int or NumPy integer >= 1; bools are not counts."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and bool(value >= 1)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (bools refused), else ``ValueError`` naming ``name``.

    Example:
      >>> positive_int("steps", 3)
      3
    """
    if not is_positive_int(value):
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}.")
    return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    """As :func:`positive_int`, with ``None`` allowed (and returned) for "no limit"."""
    if value is None:
        return None
    if not is_positive_int(value):
        raise ValueError(f"`{name}` must be a positive int or None. Received: {name}={value!r}.")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int >= 0 (bools refused): ``TypeError`` for a non-int,
    ``ValueError`` for a negative one, each naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"`{name}` must be an int. Received: {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0. Received: {name}={value}.")
    return int(value)
