"""Import paths in a config: ``package.module:function`` names your code.

A config names its model, data and step functions (and layouts kept in code) by import
path; this module imports what one names, and says which config field was wrong when
the module or attribute is missing (with the closest attribute name).

Example:
  >>> fn = resolve_callable("distrain.models:from_pretrained", "model.fn")
  >>> fn.__name__
  'from_pretrained'
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from distrain._src.train.config_errors import ConfigError

__all__ = ["resolve_callable", "resolve_import"]


def resolve_callable(path: str, field: str) -> Callable[..., Any]:
    """Imports ``package.module:function`` (or ``package.module.function``).

    Raises:
      ConfigError: naming ``field``, if the module or attribute is missing (with the
        closest attribute name) or the object is not callable.
    """
    obj = resolve_import(path, field)
    if not callable(obj):
        raise ConfigError(f"Config field {field!r}: {path!r} is not callable ({obj!r}).")
    return obj


def resolve_import(path: str, field: str) -> Any:
    """The object ``package.module:name`` names (``resolve_callable`` without the
    callable check)."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"Config field {field!r} must be an import path 'package.module:function'. "
            f"Received: {path!r}."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"Config field {field!r}: cannot import module {module_name!r} ({e}). Is the "
            "package installed or on PYTHONPATH (run from the directory that contains it)?"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" Did you mean {module_name}:{close[0]}?" if close else ""
            raise ConfigError(
                f"Config field {field!r}: module {module_name!r} has no attribute {part!r}.{hint}"
            )
        obj = getattr(obj, part)
    return obj
