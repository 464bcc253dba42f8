"""Where the Trainer is: its loop record, and its position in the passes over the data.

:class:`LoopState` is the loop's position (epoch, step, history...) that callbacks read
as ``trainer.loop``; its counters are saved with every checkpoint
(``Trainer.progress``).

The Trainer reads batches through a :class:`PassIterator`. A *pass* is one
``iter(dataset)``; when it ends, the next batch comes from a new pass (if the epoch
length is known) or the epoch ends with it (if not). Its position is saved with
every checkpoint as JSON:

* ``{"iterator": <state>}`` when the dataset's iterator has ``get_state`` (e.g.
  ``ArrayPipeline``): restored with ``set_state``, exact and O(1);
* ``{"iterator": None, "position": n}`` otherwise: restored by drawing ``n`` batches
  from a new pass, exact for any deterministic, re-iterable dataset;
* ``{"pass_ended": True}`` between passes.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings
from collections.abc import Iterable
from typing import Any, final

import numpy as np

from distrain._src.train.history import History


@final
@dataclasses.dataclass(slots=True)
class LoopState:
    """Where ``Trainer.fit`` is: the record callbacks read as ``trainer.loop``.

    The Trainer alone writes it. A callback changes the loop only through the
    Trainer's explicit means: ``trainer.stop_training = True`` (stop after the current
    dispatch), ``trainer.state = ...`` (e.g. ``EarlyStopping``'s best weights) and
    ``trainer.resume(...)`` (continue from a checkpoint, in ``on_train_begin`` of a callback
    with ``restores_progress = True``).

    Attributes:
      epoch: the current epoch (0-based).
      global_step: training steps completed, across epochs (and across a resume).
      step_in_epoch: steps completed in the current epoch.
      initial_epoch: the epoch this ``fit`` started (or resumed) at.
      initial_step: the ``global_step`` this ``fit`` started (or resumed) at.
      epochs: the ``epochs`` asked of ``fit`` (``None`` when only ``steps`` was).
      steps: the ``steps`` asked of ``fit``, or ``None``.
      steps_per_epoch: the epoch length when known, else ``None``.
      has_validation: whether ``fit`` got ``validation_data``.
      in_fit: whether ``fit`` is running.
      history: the per-epoch logs so far.
    """

    epoch: int = 0
    global_step: int = 0
    step_in_epoch: int = 0
    initial_epoch: int = 0
    initial_step: int = 0
    epochs: int | None = None
    steps: int | None = None
    steps_per_epoch: int | None = None
    has_validation: bool = False
    in_fit: bool = False
    history: History = dataclasses.field(default_factory=History)

    def finished(self) -> bool:
        """Whether the asked ``epochs`` or ``steps`` are done."""
        if self.epochs is not None and self.epoch >= self.epochs:
            return True
        return self.steps is not None and self.global_step >= self.steps

    def steps_left_in_epoch(self) -> float:
        """Steps before the epoch or the run ends (``math.inf`` when neither is bounded)."""
        left: float = math.inf
        if self.steps_per_epoch is not None:
            left = self.steps_per_epoch - self.step_in_epoch
        if self.steps is not None:
            left = min(left, self.steps - self.global_step)
        return left

    def data_ended(self) -> DataEndedError:
        """The error for training data that ran out here."""
        if self.steps is not None:
            wanted = f"steps={self.steps}"
        elif self.steps_per_epoch is not None:
            wanted = f"{self.epochs} epochs x {self.steps_per_epoch} steps"
        else:
            wanted = f"epochs={self.epochs} (epoch {self.epoch} got no batch)"
        return DataEndedError(
            f"The training data ended after {self.global_step} steps, but fit asked for "
            f"{wanted}. Make the dataset repeat (e.g. ArrayPipeline(num_epochs=None)), pass "
            "a re-iterable dataset instead of a one-shot iterator, or ask for fewer steps."
        )


class DataEndedError(ValueError):
    """The training data ran out before the requested steps or epochs were done."""


def steps_per_epoch_of(data: Any) -> int | None:
    """Steps in one pass of ``data`` if it says (``steps_per_epoch`` or ``len``), else None."""
    source = data
    # A distributed dataset wraps the user's dataset; ask the wrapped one.
    inner = getattr(data, "dataset", None) or getattr(data, "_dataset", None)
    if inner is not None and hasattr(data, "strategy"):
        source = inner
    spe = getattr(source, "steps_per_epoch", None)
    if isinstance(spe, int) and spe > 0:
        return spe
    try:
        n = len(source)
    except TypeError:
        return None
    return n if n > 0 else None


class PassIterator:
    """Draws batches from successive passes over a (distributed) dataset.

    Args:
      dataset: an iterable of per-replica batches.
      steps_per_epoch: the epoch length if known (passes then restart inside an epoch).
    """

    def __init__(self, dataset: Iterable[Any], steps_per_epoch: int | None) -> None:
        self._dataset = dataset
        self._spe = steps_per_epoch
        self._it: Any = None
        self._ended = False
        self._position = 0  # batches drawn from the current pass
        self._pending_state: Any = None
        self._skip = 0

    def begin_epoch(self) -> None:
        """With epoch = pass (unknown length): a new epoch starts a new pass."""
        if self._ended:
            self._it, self._ended = None, False

    def _new_pass(self) -> tuple[Any, bool]:
        # Any: set_state is optional; a state is only pending if the dataset's
        # iterator had get_state when it was saved.
        it: Any = iter(self._dataset)
        self._position = 0
        restored = False
        if self._pending_state is not None:
            it.set_state(self._pending_state)
            self._pending_state, restored = None, True
        elif self._skip:
            for _ in range(self._skip):
                next(it)
            self._position, self._skip, restored = self._skip, 0, True
        return it, restored

    def take(self, n: int, *, new_pass_ok: bool) -> list[Any]:
        """Up to ``n`` batches; fewer when the data ends (or the pass, if not ``new_pass_ok``)."""
        out: list[Any] = []
        fresh = False
        while len(out) < n:
            if self._ended:
                if not new_pass_ok:
                    break
                self._it, self._ended = None, False
            if self._it is None:
                self._it, restored = self._new_pass()
                fresh = not restored
            try:
                out.append(next(self._it))
            except StopIteration:
                self._ended = True
                if fresh:
                    break  # a new pass without a single batch: the data is exhausted
                continue
            self._position += 1
            fresh = False
        return out

    def get_state(self, *, epoch_done: bool = False) -> dict[str, Any]:
        """The position as JSON-compatible data."""
        if self._it is None or self._ended:
            return {"iterator": None, "pass_ended": self._ended or self._it is None}
        get = getattr(self._it, "get_state", None)
        if get is not None:
            try:
                return {"iterator": get(), "position": self._position}
            except TypeError:
                pass  # the distributed iterator's source has no state of its own
        return {"iterator": None, "position": self._position}

    def restore(self, state: Any, step_in_epoch: int) -> None:
        """Continues from a position saved by :meth:`get_state`."""
        self._it, self._ended, self._skip, self._pending_state = None, False, 0, None
        if not state:
            if step_in_epoch:
                warnings.warn(
                    "The checkpoint has no data position; the resumed epoch starts its data "
                    f"from the beginning although {step_in_epoch} steps of it were done.",
                    stacklevel=3,
                )
            return
        if state.get("pass_ended"):
            self._ended = True
        elif state.get("iterator") is not None:
            self._pending_state = state["iterator"]
        else:
            self._skip = int(state.get("position", 0))


def sums_to_json(metric: Any) -> dict[str, Any]:
    """A metric's sums as JSON data (its class by import path), for checkpoints."""
    cls = type(metric)
    fields = {
        f.name: np.asarray(getattr(metric, f.name)).tolist() for f in dataclasses.fields(metric)
    }
    return {"type": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}


def sums_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`sums_to_json` for a dict of metrics.

    A checkpoint is data: only a ``dt.metrics.Metric`` subclass it names is created
    (with arrays of floats), nothing else it names is called.

    Raises:
        ValueError: a name is not a ``dt.metrics.Metric`` subclass.
    """
    from distrain._src.train.metrics import Metric

    out = {}
    for name, item in data.items():
        module, _, qualname = item["type"].partition(":")
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, Metric)):
            raise ValueError(
                f"The checkpoint's sums of metric {name!r} name {item['type']!r}, which is not "
                "a dt.metrics.Metric subclass. Expected the class of a metric the train step "
                "returns: the checkpoint was altered or not written by distrain."
            )
        out[name] = cls(**{k: np.asarray(v, np.float64) for k, v in item["fields"].items()})
    return out
