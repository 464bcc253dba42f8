"""Public names that moved keep working for a release, with a ``DeprecationWarning``.

One public path per name stays the rule; a name that moves is listed here under the
module it used to live in, with its new path. Accessing it there warns (naming the new
path and the release that drops it) and returns the very same object. Deprecated names
are not in ``__all__`` or ``dir()``: completions show only the current API. TensorFlow's
``tf.distribute.experimental.*`` spellings that a migrating user writes are kept the
same way.

The public modules install :func:`getattr_hook` through ``distrain._src.lazy.exports``
(or directly, for modules without lazy names). ``tests/test_deprecations.py`` checks
every entry, and ``CHANGELOG.md`` lists them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.3"

# module -> {old name: (new public path, "module:attribute" of the object)}
TABLE: dict[str, dict[str, tuple[str, str]]] = {
    "distrain": {
        # Moved to dt.checkpoint (one public path per name), in 0.1 without a warning.
        "CheckpointManager": (
            "dt.checkpoint.CheckpointManager",
            "distrain.checkpoint:CheckpointManager",
        ),
        "CheckpointCorruptionError": (
            "dt.checkpoint.CheckpointCorruptionError",
            "distrain.checkpoint:CheckpointCorruptionError",
        ),
        "PreemptionHandler": (
            "dt.checkpoint.PreemptionHandler",
            "distrain.checkpoint:PreemptionHandler",
        ),
        "PREEMPTION_EXIT_CODE": (
            "dt.checkpoint.PREEMPTION_EXIT_CODE",
            "distrain.checkpoint:PREEMPTION_EXIT_CODE",
        ),
        "Restored": ("dt.checkpoint.Restored", "distrain.checkpoint:Restored"),
    },
    "distrain.experimental": {
        # TensorFlow 2.x: tf.distribute.experimental.MultiWorkerMirroredStrategy.
        "MultiWorkerMirroredStrategy": (
            "dt.MultiWorkerMirroredStrategy",
            "distrain:MultiWorkerMirroredStrategy",
        ),
        # TensorFlow: tf.distribute.experimental.CommunicationOptions / ...Implementation,
        # and its older CollectiveCommunication.
        "CommunicationOptions": ("dt.CommunicationOptions", "distrain:CommunicationOptions"),
        "CommunicationImplementation": (
            "dt.CommunicationImplementation",
            "distrain:CommunicationImplementation",
        ),
        "CollectiveCommunication": (
            "dt.CommunicationImplementation",
            "distrain:CommunicationImplementation",
        ),
        # TensorFlow 2.x: tf.distribute.experimental.TPUStrategy (TF deprecated it in 2.3).
        "TPUStrategy": ("dt.TPUStrategy", "distrain:TPUStrategy"),
    },
    "distrain.data": {
        # tf.distribute names, moved to dt itself.
        "InputContext": ("dt.InputContext", "distrain:InputContext"),
        "InputOptions": ("dt.InputOptions", "distrain:InputOptions"),
    },
}


def _public(module: str) -> str:
    return "dt" + module[len("distrain") :]


def message(module: str, name: str) -> str:
    """The warning for ``module.name``."""
    new, _ = TABLE[module][name]
    return (
        f"{_public(module)}.{name} is deprecated; use {new}. The old name will be removed "
        f"in distrain {REMOVED_IN} (see CHANGELOG.md)."
    )


def resolve(module: str, name: str) -> Any:
    """The object ``module.name`` stands for, without warning."""
    target_module, _, attr = TABLE[module][name][1].partition(":")
    return getattr(importlib.import_module(target_module), attr)


def getattr_hook(module: str, fallback: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__``: ``fallback`` (lazy names) first, then the deprecated
    names of ``module`` (warning at every access), else ``AttributeError``."""
    deprecated = TABLE.get(module, {})

    def __getattr__(name: str) -> Any:
        if fallback is not None:
            try:
                return fallback(name)
            except AttributeError:
                if name not in deprecated:
                    raise
        if name not in deprecated:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(message(module, name), DeprecationWarning, stacklevel=2)
        return resolve(module, name)

    return __getattr__
