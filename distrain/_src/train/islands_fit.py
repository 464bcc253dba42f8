"""``Trainer.fit`` over fault-isolated islands: the Trainer's callbacks, validation and
logs around the islands' loop (``Trainer(..., islands=FaultIsolation(...))``).

The loop itself is the islands' (``islands/island_loop.py``): leases, inner steps, the
pseudo-gradient, rejoins. This module tells the Trainer's callbacks what happens, with
one mapping: **a callback's epoch is a round**. Round ``r`` calls ``on_epoch_begin(r)``,
``on_train_batch_end`` after each inner step (``step = r x sync_every + k``, the same
numbering on every island and across restarts), and ``on_epoch_end(r, logs)`` with the
round's ``rows`` and ``loss`` (none without rows) and, every ``validation_freq``
rounds, ``val_*`` metrics of the **global** parameters the round started from. A round
that is not applied (a shard holder restarted and lost a pseudo-gradient of it) is
trained again: its callbacks run again, and the history keeps the applied attempt.
``BackupAndRestore`` on an island backs up its own state and position; a restarted
island resumes its callbacks and logs from it and, when no live peer heals it, its
inner optimizer state too (its parameters always come from the run: the coordinator's
are newer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from distrain._src.train.callbacks.base import Callback, CallbackList, StepInfo
from distrain._src.train.history import History

if TYPE_CHECKING:
    from distrain._src.train.trainer import Trainer

__all__ = ["fit_islands"]


def _host(tree: Any) -> Any:
    """``tree`` with NumPy leaves on every process (a collective over the island)."""
    from distrain._src.islands.island_loop import host_leaves

    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, host_leaves(leaves))


def _refuse(callbacks: CallbackList) -> None:
    from distrain._src.train.callbacks.goodput import Goodput

    for cb in callbacks.callbacks:
        if isinstance(cb, Goodput):
            raise ValueError(
                "fault-isolated islands keep a goodput ledger of their own in "
                "DIRECTORY/island-I (read it with `distrain goodput DIRECTORY/island-I`); "
                "dt.callbacks.Goodput would keep a second one. Received it among the "
                "callbacks: remove it."
            )


class _Rounds:
    """The islands' round hooks (``island_loop.RoundHooks``) as the Trainer's callbacks."""

    def __init__(
        self,
        trainer: Trainer,
        callbacks: CallbackList,
        sync_every: int,
        validation: tuple[Iterable[Any] | None, int, int | None],
    ) -> None:
        self.trainer, self.callbacks, self.sync_every = trainer, callbacks, sync_every
        self.validation_data, self.validation_freq, self.validation_steps = validation
        self.val: dict[str, float] = {}

    def validate(self, params: Any) -> dict[str, float]:
        """``val_*`` metrics of ``params`` (every process of the island calls it)."""
        t = self.trainer
        assert self.validation_data is not None
        state = t.state.replace(params=t.strategy.put_replicated(params))
        val = t.evaluate(state, self.validation_data, steps=self.validation_steps,
                         _callbacks=self.callbacks)  # fmt: skip
        return {f"val_{k}": v for k, v in val.items()}

    def begin(self, r: int, params: Any) -> None:
        loop = self.trainer.loop
        loop.epoch, loop.step_in_epoch, loop.global_step = r, 0, r * self.sync_every
        self.callbacks.call("on_epoch_begin", r, None)
        due = self.validation_data is not None and (r + 1) % self.validation_freq == 0
        self.val = self.validate(params) if due else {}

    def step(self, r: int, index: int, state: Any) -> None:
        t, loop = self.trainer, self.trainer.loop
        t.state = state
        loop.global_step, loop.step_in_epoch = r * self.sync_every + index + 1, index + 1
        if self.callbacks.listens("on_train_batch_end"):
            info = StepInfo(loop.global_step, r, loop.step_in_epoch, 1, None, state)
            self.callbacks.call("on_train_batch_end", info)
        if t.stop_training:
            raise ValueError(
                "a callback set stop_training in a fault-isolated island, which trains until "
                "the run's rows are committed (the others would wait for this island's "
                "leases until its death timeout). Expected callbacks that do not stop fit "
                "(EarlyStopping, TerminateOnNaN): remove them from the islands' callbacks."
            )

    def end(self, r: int, entry: dict[str, Any]) -> None:
        t = self.trainer
        # An island may get no rows (the run's last round): then it has no loss.
        loss = {"loss": entry["loss"]} if entry["loss"] is not None else {}
        logs = {"rows": entry["rows"], **loss, **self.val}
        t.loop.history.append(r, logs)
        t._epoch_done = True  # a save now records the next round as where to go on
        self.callbacks.call("on_epoch_end", r, logs)
        t._epoch_done = False
        t.loop.epoch = r + 1

    def retry(self, r: int) -> None:
        """Round ``r`` was not applied (a shard holder lost it) and is trained again: the
        history keeps only the attempt that is applied (the callbacks saw both)."""
        history = self.trainer.loop.history
        if history.epoch and history.epoch[-1] == r:
            history.epoch.pop()
            for values in history.history.values():
                values.pop()


def fit_islands(
    trainer: Trainer,
    state: Any,
    data: Any,
    epochs: int | None,
    more: dict[str, Any],
    validation: tuple[Iterable[Any] | None, int, int | None],
    callbacks: Sequence[Callback],
) -> tuple[Any, History]:
    """``trainer.fit`` when ``trainer.islands`` is set (see the module's docstring);
    returns the final global parameters in the island's state, and the rounds' history.

    Raises:
      ValueError: ``steps``, ``steps_per_epoch`` or ``initial_epoch`` (``more``): the
        coordinator hands out ``epochs`` passes over the rows, nothing else.
    """
    extra = {k: v for k, v in more.items() if v}
    if extra or epochs is None:
        raise ValueError(
            "fit over fault-isolated islands runs `epochs` passes over the rows (the "
            "coordinator hands them out); steps, steps_per_epoch and initial_epoch do not "
            f"apply. Received: {extra or {'epochs': None}}. Pass epochs= only."
        )
    islands = trainer.islands
    assert islands is not None and trainer._step_fn is not None
    loop = trainer.loop
    loop.epochs = loop.steps = None  # the run ends when its rows are committed
    loop.steps_per_epoch = islands.sync_every
    loop.has_validation = validation[0] is not None
    trainer.state = trainer.strategy.put_replicated(state)
    cbs = trainer._cbs = CallbackList([*trainer.callbacks, *callbacks], trainer)
    cbs.check_state_keys()
    _refuse(cbs)
    rounds = _Rounds(trainer, cbs, islands.sync_every, validation)
    loop.in_fit = True
    try:
        cbs.call("on_train_begin", None)
        own = _host(trainer.state)  # a BackupAndRestore may have restored the island's own
        result = islands.run(trainer._step_fn, state, data, epochs=epochs,
                             strategy=trainer.strategy, hooks=rounds,
                             joiner_state=own)  # fmt: skip
        trainer.state = trainer.state.replace(params=trainer.strategy.put_replicated(result.params))
        logs = rounds.validate(result.params) if validation[0] is not None else {}
        cbs.call("on_train_end", logs)
    except BaseException as e:
        cbs.abort(e)
        raise
    finally:
        loop.in_fit = False
    return trainer.state, loop.history
