"""The callback interface of ``Trainer.fit``, the step-info record and ``LambdaCallback``.

Hooks are called on every process, in the order the callbacks were given, with one
exception: ``on_train_begin`` runs first on the callbacks that resume the run
(``restores_progress = True``, e.g. ``BackupAndRestore``), so every other callback sees
the resumed position (``trainer.loop.initial_step``) whatever the list's order; a logger
listed before ``BackupAndRestore`` keeps the killed run's lines. Callbacks
that only write files for people (progress bar, TensorBoard, CSV/JSON logs) act on
the chief alone; checkpoint callbacks act on every process because saving is a
collective operation with several processes.

During ``fit`` a callback reads where the loop is in ``self.trainer.loop``, a
:class:`dt.callbacks.LoopState` record (``epoch``, ``global_step``, ``step_in_epoch``,
``initial_epoch``/``initial_step``, ``history``...), and the latest state in
``self.trainer.state`` (keep ``trainer.state_snapshot()`` to hold on to it, since steps
donate it). The loop record is the Trainer's to write; what a callback may change is
explicit: ``trainer.stop_training = True`` stops ``fit`` after the current dispatch,
``trainer.state = ...`` replaces the state (``EarlyStopping``'s best weights), and
``trainer.resume(...)`` continues from a checkpoint (in ``on_train_begin`` of a
callback that sets ``restores_progress = True``).

A callback can keep a small JSON-compatible state across a resume (e.g. an experiment
tracker's run id): what its ``state_dict`` returns is saved with the Trainer's progress
in every checkpoint, and ``Trainer.resume`` hands it back to ``load_state_dict``.

Example:
  >>> class PrintLR(dt.callbacks.Callback):
  ...     def on_epoch_end(self, epoch, logs=None):
  ...         print(epoch, logs["loss"])
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distrain._src.train.trainer import Trainer

Logs = Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What ``on_train_batch_end`` receives after each dispatch of training steps.

    Attributes:
      step: training steps completed so far (global, across epochs).
      epoch: the current epoch (0-based).
      step_in_epoch: steps completed in the current epoch.
      num_steps: steps run by this dispatch (``steps_per_execution``, fewer at the end).
      logs: metrics averaged over the steps since the previous log, or ``None`` when
        this step did not sync with the host (see ``Trainer(log_every=...)``).
      state: the state after this step. Its arrays may still be computing; reading
        their values waits for them.
    """

    step: int
    epoch: int
    step_in_epoch: int
    num_steps: int
    logs: dict[str, float] | None
    state: Any


class Callback:
    """Base class: override the hooks you need; all default to doing nothing."""

    trainer: Trainer | None = None
    #: True for a callback whose ``on_train_begin`` may call ``trainer.resume``: it runs
    #: before every other callback's ``on_train_begin``.
    restores_progress: bool = False

    @property
    def step_interval(self) -> int | None:
        """Steps between this callback's actions when it acts on step counts (e.g. a save
        every N steps), else None. ``steps_per_execution="auto"`` fuses no more."""
        return None

    def set_trainer(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @property
    def state_key(self) -> str:
        """The name this callback's ``state_dict`` is saved under (default: its class name)."""
        return type(self).__name__

    def state_dict(self) -> dict[str, Any] | None:
        """JSON-compatible state to save with each checkpoint, or None (the default).

        Called on every process when a checkpoint callback saves the Trainer's progress.
        """
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back what ``state_dict`` returned when the restored checkpoint was saved."""

    @property
    def _fit_trainer(self) -> Trainer:
        """``self.trainer`` where a hook needs one: it is set before any hook runs."""
        if self.trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a Trainer: pass it in "
                "Trainer(callbacks=[...]) or fit(callbacks=[...]) instead of calling its hooks."
            )
        return self.trainer

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Before the first step. Raise here to fail early (e.g. an unwritable directory)."""

    def on_train_end(self, logs: Logs | None = None) -> None:
        """After the last epoch, when ``fit`` succeeded."""

    def on_train_abort(self, error: BaseException) -> None:
        """When ``fit`` is leaving with ``error``: release resources, keep what was saved."""

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        """Before the first step of ``epoch``."""

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """After ``epoch`` (and its validation); ``logs`` holds train and ``val_`` metrics."""

    def on_train_batch_end(self, info: StepInfo) -> None:
        """After each dispatch of ``info.num_steps`` training steps."""

    def on_test_begin(self, logs: Logs | None = None) -> None:
        """Before ``evaluate`` (also the validation inside ``fit``)."""

    def on_test_end(self, logs: Logs | None = None) -> None:
        """After ``evaluate``, with its metrics."""

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        """Before ``predict``."""

    def on_predict_end(self, logs: Logs | None = None) -> None:
        """After ``predict``."""


class CallbackList:
    """Calls a hook on every callback in order (what the Trainer uses)."""

    def __init__(self, callbacks: Any, trainer: Trainer) -> None:
        callbacks = list(callbacks or ())
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(
                    "Every callback must be a dt.callbacks.Callback (subclass it, or wrap "
                    f"functions in dt.callbacks.LambdaCallback). Received: {cb!r}."
                )
        self.callbacks = callbacks
        for cb in callbacks:
            cb.set_trainer(trainer)
        # Only the callbacks that override a hook are called for it: the training loop
        # calls on_train_batch_end after every dispatch, and builds its StepInfo only
        # when someone listens.
        # Resuming callbacks begin first (a stable sort): the others' on_train_begin must
        # see where the run continues, or a logger that saw step 0 would truncate the
        # killed run's lines.
        begin_order = sorted(callbacks, key=lambda cb: not cb.restores_progress)
        self._by_hook = {
            h: [
                getattr(cb, h)
                for cb in (begin_order if h == "on_train_begin" else callbacks)
                if _overrides(cb, h)
            ]
            for h in _HOOKS
        }
        self._resumers = sum(
            cb.restores_progress and _overrides(cb, "on_train_begin") for cb in callbacks
        )
        #: Whether the callback running now may call ``trainer.resume``.
        self.accepts_resume = False

    def listens(self, hook: str) -> bool:
        """Whether any callback overrides ``hook``."""
        return bool(self._by_hook[hook])

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for i, method in enumerate(self._by_hook[hook]):
            self.accepts_resume = hook == "on_train_begin" and i < self._resumers
            method(*args)
        self.accepts_resume = False

    def check_state_keys(self) -> None:
        """Callbacks that save a state with checkpoints need distinct ``state_key``s: two
        under one key would overwrite each other (and resume into one another's state)."""
        seen: dict[str, Callback] = {}
        for cb in self.callbacks:
            if type(cb).state_dict is Callback.state_dict:
                continue  # saves nothing
            if cb.state_key in seen:
                raise ValueError(
                    f"Two callbacks save their state under the key {cb.state_key!r}: "
                    f"{seen[cb.state_key]!r} and {cb!r}. Give one a distinct `state_key` "
                    "(override the property) so that a resumed fit restores each its own."
                )
            seen[cb.state_key] = cb

    def state_dicts(self) -> dict[str, Any]:
        """Each callback's ``state_dict()`` (those that have one) by ``state_key``."""
        states = {}
        for cb in self.callbacks:
            state = cb.state_dict()
            if state is not None:
                states[cb.state_key] = state
        return states

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        """Hands each callback its saved state (what :meth:`state_dicts` returned)."""
        for cb in self.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])

    def abort(self, error: BaseException) -> None:
        """Calls ``on_train_abort`` on all callbacks even if one of them raises."""
        first: BaseException | None = None
        for cb in self.callbacks:
            try:
                cb.on_train_abort(error)
            except Exception as e:  # noqa: BLE001 - re-raised after every callback ran
                first = first or e
        if first is not None:
            raise first


_HOOKS = (
    "on_train_begin",
    "on_train_end",
    "on_train_abort",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_predict_begin",
    "on_predict_end",
)


def _overrides(cb: Callback, hook: str) -> bool:
    """Whether ``cb`` defines ``hook`` (in its class or, for LambdaCallback, itself)."""
    return hook in vars(cb) or getattr(type(cb), hook) is not getattr(Callback, hook)


class LambdaCallback(Callback):
    """A callback made of functions, one per hook (like ``keras.callbacks.LambdaCallback``).

    Args:
      **hooks: hook name -> function with that hook's arguments, e.g.
        ``on_epoch_end=lambda epoch, logs: ...`` or ``on_train_batch_end=lambda info: ...``.

    Raises:
      TypeError: for a name that is not a hook, or a value that is not callable.

    Example:
      >>> losses = []
      >>> cb = dt.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: losses.append(logs["loss"]))
    """

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        for name, fn in hooks.items():
            if name not in _HOOKS:
                raise TypeError(
                    f"LambdaCallback got an unknown hook {name!r}. Expected one of: "
                    f"{', '.join(_HOOKS)}."
                )
            if not callable(fn):
                raise TypeError(f"LambdaCallback hook {name!r} must be callable. Received: {fn!r}.")
            setattr(self, name, fn)


def ensure_writable_dir(path: str | os.PathLike[str], what: str) -> str:
    """Creates ``path`` if needed and proves it writable by writing a file into it.

    Raises:
      OSError: naming ``what`` and ``path``, if it cannot be created or written.
    """
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".distrain-write-test-"):
            pass
    except OSError as e:
        raise OSError(
            f"{what} directory {path!r} is not writable ({e.strerror or e}). Expected a "
            "directory this process can create files in; choose another path or fix its "
            "permissions."
        ) from e
    return path
