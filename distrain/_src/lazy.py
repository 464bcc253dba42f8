"""Lazy re-exports: a public name imports its module on first use.

``import distrain`` would otherwise import orbax (checkpoints), grain (pipelines),
tensorboardX and the parameter-server backends, which a training script that uses
none of them pays for at every start (and so does every subprocess a test or the
launcher starts). A package lists such names in a ``{name: "module[:attr]"}`` table
and installs :func:`exports`' module ``__getattr__`` / ``__dir__``, which also serves the
module's deprecated names (``deprecations.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from distrain._src import deprecations


def exports(
    namespace: dict[str, Any], table: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a module whose ``table`` names load on first use.

    Example:
      >>> __getattr__, __dir__ = exports(globals(), {"CheckpointManager":
      ...     "distrain._src.checkpoint.manager:CheckpointManager"})
    """
    name = namespace["__name__"]

    def lazy(attr: str) -> Any:
        target = table.get(attr)
        if target is None:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        module_name, _, member = target.partition(":")
        module = importlib.import_module(module_name)
        value = getattr(module, member) if member else module
        namespace[attr] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return deprecations.getattr_hook(name, lazy), __dir__
