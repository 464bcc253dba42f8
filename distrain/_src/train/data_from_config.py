"""The data a run config's ``data`` section names: loaded by ``data.fn`` and batched.

``data.fn`` returns ``{"train": ..., "test": ...}``; a split of NumPy arrays is batched
here with ``ArrayPipeline`` (the training split shuffled and repeated, the others
padded and masked once through), and any other split is used as is. Errors name the
config field: a batch size that does not split over the replicas, data that cannot be
read (MNIST offline), a missing ``train`` split.

Example:
  >>> splits = load_data(cfg, resolve_callable(cfg.data.fn, "data.fn"))
  >>> data = pipelines(cfg, splits, strategy.num_replicas_in_sync)
  >>> next(iter(data["train"]))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from distrain._src.padding import MASK_KEY
from distrain._src.train.config import RunConfig
from distrain._src.train.config_errors import ConfigError

__all__ = ["load_data", "pipelines"]


def _check_divisible(field: str, batch: int, num_replicas: int) -> None:
    """A config batch size must split evenly over the replicas (each gets an equal share)."""
    if batch % num_replicas:
        lo, hi = batch // num_replicas * num_replicas, (batch // num_replicas + 1) * num_replicas
        use = f"{lo} or {hi}" if lo else f"{hi}"
        raise ConfigError(
            f"Config field {field!r}: {field} ({batch}) must be divisible by the number of "
            f"replicas ({num_replicas}): every replica gets an equal share of each "
            f"batch. Use {use} (a multiple of {num_replicas}), or choose the devices with "
            "strategy.devices=[...]."
        )


def pipelines(cfg: RunConfig, splits: Any, num_replicas: int) -> dict[str, Iterable[Any]]:
    """``data.fn``'s splits as the Trainer takes them: splits of arrays batched with
    ``ArrayPipeline`` (training: shuffled and repeated; others: padded and masked), the
    others as they are."""
    from distrain._src.data.pipeline import ArrayPipeline

    if not isinstance(splits, Mapping) or "train" not in splits:
        got = sorted(splits) if isinstance(splits, Mapping) else type(splits).__name__
        raise ConfigError(
            f"Config field 'data.fn' must return a dict with a 'train' split (and usually "
            f"'test'). {cfg.data.fn} returned: {got}."
        )
    out: dict[str, Iterable[Any]] = {}
    eval_batch = cfg.data.eval_batch_size or cfg.data.global_batch_size
    eval_field = "data.eval_batch_size" if cfg.data.eval_batch_size else "data.global_batch_size"
    for name, split in splits.items():
        if not isinstance(split, Mapping):
            out[name] = split  # already an iterable of global batches
            continue
        field, batch = ("data.global_batch_size", cfg.data.global_batch_size)
        if name != "train":
            field, batch = eval_field, eval_batch
        _check_divisible(field, batch, num_replicas)
        try:
            if name == "train":
                out[name] = ArrayPipeline(
                    dict(split),
                    global_batch_size=batch,
                    seed=cfg.seed,
                    shuffle=cfg.data.shuffle,
                    num_epochs=None,
                    drop_remainder=True,
                )
            else:
                out[name] = ArrayPipeline(
                    dict(split),
                    global_batch_size=batch,
                    shuffle=False,
                    num_epochs=1,
                    drop_remainder=False,
                    mask_key=MASK_KEY,
                )
        except ValueError as e:
            raise ConfigError(
                f"Config section 'data': the {name!r} split of {cfg.data.fn} with "
                f"{field}={batch}: {e}"
            ) from e
    return out


def load_data(cfg: RunConfig, data_fn: Callable[..., Any]) -> Any:
    """Calls ``data.fn``; data it cannot read or fetch becomes a ConfigError.

    An ``OSError`` (a missing file, a download that fails: ``dt.data.load_mnist``
    offline) is the machine's state, not a bug in the code, so it is reported as one
    line naming the config field; the error's own message says what to do. A library
    message may name keyword arguments of its own function: the line lists those
    ``data.fn`` takes, the ones a config can set, as ``data.kwargs.NAME``.
    """
    try:
        return data_fn(**cfg.data.kwargs)
    except OSError as e:
        try:
            params = list(inspect.signature(data_fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        # Named ones only: `data.kwargs.kwargs` would set a keyword named "kwargs".
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        settable = ", ".join(f"data.kwargs.{n}" for n in names) or "none"
        raise ConfigError(
            f"Config field 'data.fn' ({cfg.data.fn}) could not load its data: {e} (From a "
            f"config the arguments of {cfg.data.fn} are set as {settable}; "
            "configs/quickstart.yaml trains on bundled data with no download.)"
        ) from e
