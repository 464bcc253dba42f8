"""The Trainer's input route: every ``fit``, ``evaluate`` and ``predict`` gets its batches here.

``fit`` calls :func:`for_fit` once: it decides whether the input lives on the devices or
streams from the host, and returns the per-replica batches, the step that consumes them
and how a batch reaches the step. ``evaluate`` and ``predict`` call :func:`distribute`.
Nothing else in ``train/`` distributes data or decides where it lives.

Device-resident input: in-memory data placed once, batches gathered inside the compiled
step.

On an accelerator the host cannot keep up with a fast step: gathering a shuffled
batch of NumPy rows and copying it to the devices costs several times the step of a
small model (measured on one H100: 0.13-0.37x of pre-staged data). When ``fit`` gets
a ``dt.data.ArrayPipeline`` whose arrays fit in device memory, it instead

* places the arrays on every device once (``strategy.put_replicated``);
* iterates a twin ``ArrayPipeline`` over the row *numbers* (same seed, batch size,
  shuffling, padding, passes and process slices, so the same permutation of
  ``(seed, epoch)``), which sends only ``int32`` row ids per step;
* gathers the rows inside the step's compiled program, padded rows zeroed as the host
  pipeline pads them.

The batches the ``train_step`` sees are the host pipeline's, value for value, and the
input position in checkpoints is the same ``{"step", "pass", ...}`` state: a run can
resume in either mode. ``Trainer(input_mode=...)`` chooses: ``"auto"`` (device when the
arrays take at most a quarter of a device's memory), ``"device"`` or ``"host"``; the
choice is ``trainer.input_mode`` after ``fit`` starts.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from distrain._src.data.batches import whole_arrays_error
from distrain._src.data.distributed import DistributedDataset
from distrain._src.data.pipeline import ArrayPipeline, Structure, flat_arrays, structure
from distrain._src.strategy._checks import check_placeable

if TYPE_CHECKING:
    from distrain._src.strategy.base import Strategy

MODES = ("auto", "device", "host")
_ROW = "row"
_BUDGET_FRACTION = 0.25


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"`input_mode` must be one of {MODES}. Received: {mode!r}.")
    return mode


class Resident:
    """The arrays of an ``ArrayPipeline`` on the devices, and how to gather batches."""

    def __init__(self, strategy: Strategy, pipeline: ArrayPipeline) -> None:
        self.pipeline = pipeline
        self.strategy = strategy
        self.arrays = strategy.replica_layout.place_dataset(check_placeable(flat_arrays(pipeline)))

    def index_pipeline(self) -> ArrayPipeline:
        """The twin pipeline over row numbers: same batches, as row ids."""
        p = self.pipeline
        return ArrayPipeline(
            {_ROW: np.arange(p.num_examples, dtype=np.int32)},
            global_batch_size=p.global_batch_size,
            seed=p.seed,
            shuffle=p.shuffle,
            reshuffle_each_epoch=p.reshuffle_each_epoch,
            num_epochs=p.num_epochs,
            drop_remainder=p.drop_remainder,
            mask_key=p.mask_key,
            process_index=p.process_index,
            process_count=p.process_count,
        )

    def batch(self, rows: Any) -> tuple[Any, Any]:
        """What the step receives per batch: the device arrays and this step's row ids."""
        return (self.arrays, rows)

    def gathering(self, train_step: Callable[..., Any]) -> Callable[..., Any]:
        """``train_step`` fed the rows that a ``(arrays, row ids)`` batch names.

        The same function object for the same strategy, step and batch structure:
        ``strategy.run`` compiles per function, and a new wrapper per ``fit`` recompiled
        the step every ``fit`` (~0.3 s for the MLP 512-2048-10 on 8 CPU devices)."""
        per_strategy = _GATHERING.setdefault(self.strategy, {})
        key = (train_step, structure(self.pipeline))
        if key not in per_strategy:
            # Weakly: a strong reference from the cached step would keep the strategy
            # (the cache's key) and its compiled programs alive for good.
            constrain = weakref.WeakMethod(self.strategy.replica_layout.constrain_batch)
            per_strategy[key] = _gathering(train_step, key[1], constrain)
        return per_strategy[key]


# Gathering steps by strategy (weakly: they go with it), then (train_step, structure).
_GATHERING: weakref.WeakKeyDictionary[Any, dict[Any, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _gathering(
    train_step: Callable[..., Any],
    batches: Structure,
    constrain: Callable[[], Callable[[Any], Any] | None],
) -> Callable[..., Any]:
    mask_key = batches.mask_key

    # The user's name (and __wrapped__): errors about what the step returns name it.
    @functools.wraps(train_step)
    def step(state: Any, batch: Any) -> Any:
        arrays, ids = batch
        leaves = [jnp.take(a, ids[_ROW], axis=0) for a in arrays]
        mask = None
        if mask_key is not None:
            mask = ids[mask_key]
            real = mask > 0
            leaves = [
                jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 1)), x, 0) for x in leaves
            ]
        # The strategy's batch_layout, if any, on the gathered rows.
        layout = constrain()  # traced while its strategy runs it: alive
        assert layout is not None
        return train_step(state, layout(batches.unflatten(leaves, mask)))

    return step


@dataclass(frozen=True)
class FitInput:
    """What ``fit`` trains on: decided once per ``fit`` by :func:`for_fit`.

    Attributes:
      mode: ``"device"`` (arrays on the devices, row ids stream) or ``"host"``.
      batches: the per-replica batches (a distributed dataset: positions, passes).
      step_fn: the step to compile: ``train_step``, gathering its rows from the
        device-resident arrays in ``"device"`` mode.
      resident: the device-resident arrays (``"device"`` mode only).
    """

    mode: str
    batches: Iterable[Any]
    step_fn: Callable[..., Any]
    resident: Resident | None = None

    def wrap(self, batch: Any) -> Any:
        """What the step receives for one of ``batches``."""
        return batch if self.resident is None else self.resident.batch(batch)


def for_fit(strategy: Strategy, data: Any, mode: str, step_fn: Callable[..., Any]) -> FitInput:
    """The input route of one ``fit``: in-memory data that fits goes to the devices once
    (``mode`` ``"auto"`` or ``"device"``) and the step gathers its rows; anything else
    is distributed from the host."""
    resident = _resident(strategy, data, mode)
    if resident is None:
        return FitInput("host", distribute(strategy, data), step_fn)
    # Row ids are not the user's batch: the strategy's batch_layout applies to the rows
    # the step gathers (Resident.gathering), not to the ids.
    ids = DistributedDataset(strategy, resident.index_pipeline(), batch_layout=False)
    return FitInput("device", ids, resident.gathering(step_fn), resident)


def _resident(strategy: Strategy, data: Any, mode: str) -> Resident | None:
    if mode == "host" or not isinstance(data, ArrayPipeline):
        return None
    nbytes = sum(leaf.nbytes for leaf in flat_arrays(data))
    if mode == "auto" and nbytes > _BUDGET_FRACTION * device_memory_bytes(strategy):
        return None
    return Resident(strategy, data)


def distribute(strategy: Strategy, data: Iterable[Any]) -> Iterable[Any]:
    """``data`` as per-replica batches of ``strategy`` (distributed unless it already is).

    Raises:
      TypeError: for whole arrays (a dict of arrays, an array, a Keras-style ``(x, y)``
        tuple of arrays) instead of batches: the message says how to batch them.
      ValueError: if ``data`` was distributed with another strategy.
    """
    whole = whole_arrays_error(data)
    if whole is not None:
        raise TypeError(whole)
    if isinstance(data, Mapping):
        raise TypeError(
            "Expected an iterable of batches (e.g. dt.data.ArrayPipeline, a list of batch "
            f"dicts, a grain dataset). Received a dict with keys {list(data)[:8]}: batch its "
            "arrays with dt.data.ArrayPipeline(arrays, global_batch_size=...)."
        )
    if isinstance(data, DistributedDataset):
        if data.strategy is not strategy:
            raise ValueError(
                "`data` was distributed with another strategy. Pass the undistributed "
                "dataset, or distribute it with this Trainer's strategy."
            )
        return data
    return strategy.experimental_distribute_dataset(data)


def device_memory_bytes(strategy: Strategy) -> int:
    """Memory of one of the strategy's devices: its allocator's limit, or for CPU
    devices (which share the host's memory) the host's memory divided among them."""
    device = next(d for d in strategy.devices if d.process_index == jax.process_index())
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, len(jax.local_devices()))
