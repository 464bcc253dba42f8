"""Calling a config's ``model.fn``: its arguments checked before the call, and what it
returns split into ``(apply_fn, params)`` (for ``distrain train``, ``distrain plan`` and
fine-tuning from a pretrained model).

Example:
  >>> check_call(model_fn, "model", "examples.classification:mlp", key=key)
  >>> apply_fn, params = split_model(model_fn(key=key))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from distrain._src.train.config_errors import ConfigError


def check_call(fn: Callable[..., Any], section: str, path: str, *args: Any, **kwargs: Any) -> None:
    """Raises ConfigError if ``fn`` cannot take these arguments (before calling it)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call itself report
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        given = ["state", "batch"][: len(args)] + sorted(kwargs)
        raise ConfigError(
            f"Config section {section!r}: {path} cannot be called with ({', '.join(given)}): "
            f"{e}. Its signature: {path.rpartition(':')[2]}{sig}."
        ) from e


def split_model(model: Any) -> tuple[Callable[..., jax.Array], Any]:
    """``(apply_fn, params)`` from an ``nnx.Module`` or an ``(apply_fn, params)`` pair.

    ``params`` is a plain nested dict of arrays (``nnx.to_pure_dict``), which
    checkpoints and restores without any flax types. A module's ``apply_fn(params, x,
    *args, **kwargs)`` passes every input on to its ``__call__`` (e.g. the LM's
    ``segment_ids`` and ``positions`` for packed rows).

    Raises:
      TypeError: for anything else, saying what a model function must return.
    """
    from flax import nnx

    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)

        def apply_fn(params: Any, x: Any, *args: Any, **kwargs: Any) -> jax.Array:
            return nnx.merge(graphdef, params)(x, *args, **kwargs)

        return apply_fn, nnx.to_pure_dict(state)
    if isinstance(model, tuple) and len(model) == 2 and callable(model[0]):
        return model[0], model[1]
    raise TypeError(
        "A model function must return a flax.nnx.Module or a tuple (apply_fn, params) with "
        f"apply_fn(params, x) -> outputs. Received: {type(model).__name__}."
    )
