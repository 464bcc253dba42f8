"""What ``Trainer.fit`` returns: the per-epoch metrics, JSON-serialisable for checkpoints."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class History:
    """Per-epoch metrics of a ``fit`` call, like ``keras.callbacks.History``.

    Attributes:
      epoch: the epoch indices that finished, in order.
      history: ``{metric name: [value per epoch]}``; validation metrics are prefixed
        ``val_`` and hold ``nan`` for epochs without validation.

    Example:
      >>> state, history = trainer.fit(state, data, epochs=3)
      >>> history.history["loss"]         # three floats
      >>> history.last("val_accuracy")    # the most recent value
    """

    def __init__(self) -> None:
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def append(self, epoch: int, logs: Mapping[str, Any]) -> None:
        """Records the end of ``epoch`` with its ``logs`` (scalars)."""
        n = len(self.epoch)
        self.epoch.append(int(epoch))
        for name in set(self.history) | set(logs):
            values = self.history.setdefault(name, [math.nan] * n)
            values.append(_to_float(logs.get(name, math.nan)))

    def last(self, name: str) -> float:
        """The latest value of metric ``name``.

        Raises:
          KeyError: if no epoch recorded ``name``; lists the recorded names.
        """
        if name not in self.history or not self.history[name]:
            raise KeyError(
                f"No metric named {name!r} in the history. Recorded: {sorted(self.history)}."
            )
        return self.history[name][-1]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (``nan`` kept as ``None``)."""
        return {
            "epoch": list(self.epoch),
            "history": {
                k: [None if math.isnan(v) else v for v in vs] for k, vs in self.history.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> History:
        """Inverse of :meth:`to_dict`."""
        h = cls()
        h.epoch = [int(e) for e in data.get("epoch", [])]
        h.history = {
            k: [math.nan if v is None else float(v) for v in vs]
            for k, vs in data.get("history", {}).items()
        }
        return h

    def __repr__(self) -> str:
        return f"History(epochs={len(self.epoch)}, metrics={sorted(self.history)})"


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
