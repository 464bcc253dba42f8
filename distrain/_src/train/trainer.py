"""``Trainer``: ``fit``, ``evaluate`` and ``predict`` for a per-replica step function.

Separation of concerns:

* the **user** writes per-replica steps: ``train_step(state, batch) -> (state,
  metrics)``, ``eval_step(state, batch) -> metrics``, ``predict_step(state, batch) ->
  outputs``; ``state`` is any pytree (a ``dt.TrainState``, or two models and two
  optimizers for a GAN);
* the **strategy** places state and batches and compiles each replica function
  (``strategy.run``), bounding the steps in flight;
* the **distributed dataset** turns global batches into per-replica ones and keeps
  the input position (``get_state``/``set_state``);
* the **Trainer** (this module) owns the loop and its one record of where it is
  (``trainer.loop``, a ``LoopState`` that callbacks read): epochs and steps, fusing
  ``steps_per_execution`` steps into one dispatch, accumulating metrics on the device
  and reading them only every ``log_every`` steps, validation, callbacks, and the
  progress record (epoch, step, history, data position, callback states) that
  checkpoints store.

The loop reads values from the device only to log (every ``log_every`` steps), at
epoch ends, and when a callback reads them (e.g. a checkpoint save). Otherwise it
waits only to keep at most two dispatches in flight (``strategy.run`` waits for
dispatch ``i-2`` before queueing ``i``), so the host runs ahead of the devices.

The seams: ``_input`` decides where the input lives and distributes it (the one input
route); ``_steps`` turns batches into compiled dispatches and keeps the on-device
metric window; ``_inference`` runs evaluate and predict; ``progress`` tracks passes and
positions; ``progress_record`` writes the record checkpoints store and reads it back.
This module is the loop: epochs, callbacks, validation, resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from distrain._src.current import get_strategy
from distrain._src.goodput import heartbeat
from distrain._src.goodput import ledger as goodput
from distrain._src.goodput.ledger import settle_steps
from distrain._src.padding import MASK_KEY
from distrain._src.strategy.base import Strategy
from distrain._src.train import _functions as F
from distrain._src.train import _inference, _input, islands_fit
from distrain._src.train._steps import Steps
from distrain._src.train.accumulation import accumulate_gradients
from distrain._src.train.callbacks.base import Callback, CallbackList, StepInfo
from distrain._src.train.callbacks.control import TerminateOnNaN
from distrain._src.train.history import History
from distrain._src.train.progress import DataEndedError, LoopState, PassIterator, steps_per_epoch_of
from distrain._src.train.progress_record import (
    progress_record,
    restore_loop,
    warn_unless_resuming_callback,
)
from distrain._src.train.trainer_args import check_islands, check_strategy
from distrain._src.validate import non_negative_int, optional_positive_int, positive_int

__all__ = ["DataEndedError", "Trainer"]


class Trainer:
    """Runs per-replica step functions under a strategy: ``fit``, ``evaluate``, ``predict``.

    Args:
      strategy: the strategy to run on (default: ``dt.get_strategy()``).
      train_step: ``train_step(state, batch) -> (new_state, metrics)``, called per
        replica on the replica's part of the batch. ``metrics`` is a dict of scalars or
        ``dt.metrics`` objects; they are summed over replicas as (total, count) so means
        are exact on partial and padded batches.
      eval_step: ``eval_step(state, batch) -> metrics`` for ``evaluate`` and validation.
      predict_step: ``predict_step(state, batch) -> outputs`` (per-example arrays).
      callbacks: ``dt.callbacks.Callback`` objects used by every ``fit``.
      steps_per_execution: steps fused into one compiled dispatch (``k`` batches
        per ``strategy.run``); larger values cut per-step host overhead for small models.
        ``"auto"`` times the first steps of each ``fit`` and picks the power of two
        that makes one dispatch take at least ~4 ms, at most ``log_every`` and any
        callback's ``step_interval`` (the choice is ``trainer.steps_per_execution``).
      log_every: steps between host syncs that read the metrics (progress bar,
        TensorBoard, ``TerminateOnNaN``); epochs always end with one.
      mask_key: batch key of the padding mask (``predict`` drops padded rows with it).
      grad_accum_steps: split each batch into this many micro-batches and apply their
        summed gradients once (``dt.accumulate_gradients``): the same update as one step
        on the whole batch, with the activations of one micro-batch in memory at a time.
      input_mode: for ``fit`` on a ``dt.data.ArrayPipeline``: ``"device"`` places its
        arrays on the devices once and gathers each batch inside the compiled step
        (row ids are all that crosses per step); ``"host"`` gathers on the host;
        ``"auto"`` (default) picks device when the arrays take at most a quarter of a
        device's memory. The choice is ``trainer.input_mode``; batches, results and
        checkpointed positions are the same in both modes.
      donate_state: let XLA update the state in place (``donate_argnums``), saving a
        copy of it per step. ``fit`` copies the state you pass in once, so your arrays
        stay valid; a callback that keeps ``trainer.state`` for later must keep
        ``trainer.state_snapshot()`` instead.
      islands: ``dt.experimental.islands.FaultIsolation(...)``: ``fit`` trains this
        process's island of a fault-isolated run (``distrain launch --islands N``) with
        ``strategy`` inside the island; a callback's epoch is then a round
        (``docs/islands.md``, "Through the Trainer").

    Attributes:
      loop: where ``fit`` is, a ``dt.callbacks.LoopState`` (epoch, global step, history,
        ...), written by the Trainer alone; callbacks read it.
      state: the latest state during ``fit`` (a callback may replace it).
      stop_training: set it to ``True`` (from a callback) to stop ``fit`` after the
        current dispatch.

    Raises:
      TypeError / ValueError: for a non-callable step or non-positive integers.

    Example:
      >>> strategy = dt.MirroredStrategy()
      >>> trainer = dt.Trainer(strategy, train_step, eval_step, log_every=50,
      ...                      callbacks=[dt.callbacks.ProgressBar()])
      >>> state, history = trainer.fit(state, train_data, epochs=5, validation_data=test_data)
      >>> trainer.evaluate(state, test_data)
      {'loss': 0.08..., 'accuracy': 0.97...}
    """

    def __init__(
        self,
        strategy: Strategy | None = None,
        train_step: Callable[..., Any] | None = None,
        eval_step: Callable[..., Any] | None = None,
        predict_step: Callable[..., Any] | None = None,
        *,
        callbacks: Sequence[Callback] = (),
        steps_per_execution: int | str = 1,
        log_every: int = 100,
        mask_key: str | None = MASK_KEY,
        donate_state: bool = True,
        grad_accum_steps: int = 1,
        input_mode: str = "auto",
        islands: Any = None,
    ) -> None:
        self.strategy = check_strategy(strategy if strategy is not None else get_strategy())
        self.islands = check_islands(islands)
        for name, fn in (
            ("train_step", train_step),
            ("eval_step", eval_step),
            ("predict_step", predict_step),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}` must be a function. Received: {fn!r}.")
        self.train_step = train_step
        self.grad_accum_steps = positive_int("grad_accum_steps", grad_accum_steps)
        self._input_mode = _input.check_mode(input_mode)
        # One optimizer update per batch, over grad_accum_steps micro-batches of it.
        self._step_fn = (
            accumulate_gradients(train_step, self.grad_accum_steps, mask_key=mask_key)
            if train_step is not None
            else None
        )
        self.eval_step = eval_step
        self.predict_step = predict_step
        self.callbacks = list(callbacks)
        CallbackList(self.callbacks, self)  # type-checks them now, not at fit time
        self._auto_k = steps_per_execution == "auto"
        if isinstance(steps_per_execution, str) and not self._auto_k:
            raise ValueError(
                "`steps_per_execution` must be a positive int or 'auto'. Received: "
                f"{steps_per_execution!r}."
            )
        self._k = 1 if self._auto_k else positive_int("steps_per_execution", steps_per_execution)
        self.log_every = positive_int("log_every", log_every)
        self.mask_key = mask_key
        self._donate = donate_state
        self.is_chief = self.strategy.is_chief

        self._eval_fn = F.make_eval_fn(eval_step) if eval_step is not None else None
        self._predict_fn = (
            F.make_predict_fn(predict_step, mask_key) if predict_step is not None else None
        )
        self._zeros = _inference.ZeroCache(self.strategy)
        self._reset_progress()

    # ---------------------------------------------------------------- progress
    def _reset_progress(self) -> None:
        self.state: Any = None
        self.loop = LoopState()
        self.stop_training = False
        self._epoch_done = False
        self._passes: PassIterator | None = None
        self._cbs: CallbackList | None = None
        self._input: _input.FitInput | None = None
        self._steps: Steps | None = None
        self._resumed_sums: dict[str, Any] | None = None

    @property
    def steps_per_execution(self) -> int:
        """Steps per dispatch: as given, or under ``"auto"`` the calibrated choice."""
        return self._steps.k if self._steps is not None else self._k

    @steps_per_execution.setter
    def steps_per_execution(self, k: int) -> None:
        self._k = positive_int("steps_per_execution", k)
        self._auto_k = False
        if self._steps is not None:  # from a callback during fit: the next dispatch
            self._steps.set_k(self._k)

    @property
    def input_mode(self) -> str | None:
        """``"device"`` or ``"host"``: where this ``fit``'s input lives (None before)."""
        return self._input.mode if self._input is not None else None

    def progress(self) -> dict[str, Any]:
        """The loop position as JSON-compatible data, for checkpoints.

        Reads the on-device metric accumulator first (a host sync), so the saved
        epoch metrics are complete. ``"callbacks"`` holds each callback's
        ``state_dict()`` (those that have one) by ``state_key``. ``BackupAndRestore``
        saves this and hands it back to :meth:`resume`.
        """
        return progress_record(self.loop, self._steps, self._epoch_done, self._cbs)

    def data_state(self) -> dict[str, Any]:
        """The training input's position (``{"iterator": state or None, ...}``)."""
        if self._passes is None:
            return {"iterator": None, "supported": False}
        return self._passes.get_state(epoch_done=self._epoch_done)

    def resume(self, state: Any, progress: dict[str, Any], data_state: Any = None) -> None:
        """Continues a ``fit`` from a saved position (call from ``on_train_begin``).

        Args:
          state: the restored state (placed like the state given to ``fit``).
          progress: what :meth:`progress` returned when the checkpoint was saved.
          data_state: what :meth:`data_state` returned then.
        """
        if not self.loop.in_fit or self._cbs is None:
            raise RuntimeError("`Trainer.resume` can only be called during fit (on_train_begin).")
        warn_unless_resuming_callback(self._cbs)
        self.state = state
        self._resumed_sums = restore_loop(self.loop, progress)
        if self._passes is not None:  # islands: the coordinator hands out the rows
            self._passes.restore(data_state, self.loop.step_in_epoch)
        self._cbs.load_state_dicts(progress.get("callbacks") or {})

    # ------------------------------------------------------------------- fit
    def fit(
        self,
        state: Any,
        data: Iterable[Any],
        *,
        epochs: int | None = None,
        steps: int | None = None,
        steps_per_epoch: int | None = None,
        validation_data: Iterable[Any] | None = None,
        validation_freq: int = 1,
        validation_steps: int | None = None,
        initial_epoch: int = 0,
        callbacks: Sequence[Callback] = (),
    ) -> tuple[Any, History]:
        """Trains ``state`` on ``data``; returns ``(final_state, history)``.

        Args:
          state: the initial state (any pytree); placed with ``strategy.put_replicated``.
          data: an iterable of *global* batches (NumPy/JAX pytrees, an
            ``ArrayPipeline``, a grain dataset) or a distributed dataset of this strategy.
          epochs: passes to run. An epoch is ``steps_per_epoch`` steps when that is
            known (argument, or ``data.steps_per_epoch`` / ``len(data)``), else one pass
            over ``data``. A pass that ends starts a new one.
          steps: total training steps (a cap when ``epochs`` is also given). Neither
            given: one epoch.
          steps_per_epoch: steps per epoch, for infinite or unsized data.
          validation_data: evaluated with ``eval_step`` after every ``validation_freq``
            epochs; its metrics enter the logs with a ``val_`` prefix.
          validation_freq: epochs between validations.
          validation_steps: batches per validation (default: one pass).
          initial_epoch: the epoch to start counting from.
          callbacks: more callbacks, for this call only.

        Raises:
          ValueError: no ``train_step``; bad arguments.
          TypeError: whole arrays (a dict of arrays, an array, an ``(x, y)`` tuple)
            instead of batches: wrap them in ``dt.data.ArrayPipeline(arrays,
            global_batch_size=...)``.
          DataEndedError: ``data`` ran out before ``steps``/``epochs`` were done.
          TypeError: ``train_step`` returned something other than ``(new_state, metrics)``.
        """
        if self._step_fn is None:  # set exactly when there is a train_step
            raise ValueError(
                "`Trainer.fit` needs a train_step: pass Trainer(strategy, train_step)."
            )
        epochs = optional_positive_int("epochs", epochs)
        steps = optional_positive_int("steps", steps)
        validation_freq = positive_int("validation_freq", validation_freq)
        if validation_data is not None and self.eval_step is None:
            raise ValueError(
                "`validation_data` needs an eval_step: pass Trainer(strategy, train_step, "
                "eval_step)."
            )
        if epochs is None and steps is None:
            epochs = 1
        self._reset_progress()
        if self.islands is not None:  # train/islands_fit.py
            more = dict(steps=steps, steps_per_epoch=steps_per_epoch, initial_epoch=initial_epoch)
            val = (validation_data, validation_freq, validation_steps)
            return islands_fit.fit_islands(self, state, data, epochs, more, val, callbacks)
        route = self._input = _input.for_fit(self.strategy, data, self._input_mode, self._step_fn)
        self.loop.epochs, self.loop.steps = epochs, steps
        self.loop.steps_per_epoch = (
            positive_int("steps_per_epoch", steps_per_epoch)
            if steps_per_epoch is not None
            else steps_per_epoch_of(data)
        )
        self.loop.epoch = self.loop.initial_epoch = non_negative_int("initial_epoch", initial_epoch)
        self.loop.global_step = self.loop.initial_step = initial_epoch * (
            self.loop.steps_per_epoch or 0
        )
        self.loop.has_validation = validation_data is not None
        self.state = self.strategy.put_replicated(state)  # a copy: donation spares `state`
        self._passes = PassIterator(route.batches, self.loop.steps_per_epoch)
        cbs = self._cbs = CallbackList([*self.callbacks, *callbacks], self)
        cbs.check_state_keys()
        nan_watched = any(isinstance(cb, TerminateOnNaN) for cb in cbs)
        self._steps = Steps(self.strategy, route.step_fn, k=self._k, auto=self._auto_k,
                            donate=self._donate, warn_not_finite=not nan_watched)  # fmt: skip
        self.loop.in_fit = True
        try:
            cbs.call("on_train_begin", None)
            logs: dict[str, float] = {}
            while not (self.stop_training or self.loop.finished()):
                logs = self._run_epoch(cbs)
                self._end_epoch(cbs, logs, validation_data, validation_freq, validation_steps)
                if self.stop_training:
                    break
            heartbeat.pause()  # what follows the loop is not watched for hangs
            cbs.call("on_train_end", logs)
        except BaseException as e:
            cbs.abort(e)
            raise
        finally:
            heartbeat.pause()
            self.loop.in_fit = False
            goodput.set_current(None)  # set by a dt.callbacks.Goodput of this fit
        return self.state, self.loop.history

    def _end_epoch(
        self,
        cbs: CallbackList,
        logs: dict[str, float],
        validation_data: Iterable[Any] | None,
        validation_freq: int,
        validation_steps: int | None,
    ) -> None:
        """Validates (every ``validation_freq`` epochs), records the epoch's logs and
        calls ``on_epoch_end``; the loop then stands at the next epoch."""
        # Absolute epoch numbers, so a resumed run validates after the same epochs.
        if validation_data is not None and (self.loop.epoch + 1) % validation_freq == 0:
            settle_steps(self.state)
            val = self.evaluate(self.state, validation_data, steps=validation_steps, _callbacks=cbs)
            logs.update({f"val_{k}": v for k, v in val.items()})
        self.loop.history.append(self.loop.epoch, logs)
        self._epoch_done = True
        cbs.call("on_epoch_end", self.loop.epoch, logs)
        self._epoch_done = False
        self.loop.epoch += 1
        self.loop.step_in_epoch = 0

    def _run_epoch(self, cbs: CallbackList) -> dict[str, float]:
        """Runs one epoch's steps; returns the epoch's training metrics."""
        assert self._passes is not None and self._steps is not None and self._input is not None
        steps = self._steps
        cbs.call("on_epoch_begin", self.loop.epoch, None)
        if self.loop.steps_per_epoch is None:
            self._passes.begin_epoch()
        steps.begin_epoch(self._resumed_sums)
        self._resumed_sums = None
        ran_any = self.loop.step_in_epoch > 0
        while not self.stop_training:
            want = min(self.steps_per_execution, self.loop.steps_left_in_epoch())
            if want <= 0:
                break
            with goodput.phase("input"):
                batches = self._passes.take(
                    int(want), new_pass_ok=self.loop.steps_per_epoch is not None
                )
            if not batches:
                if self.loop.steps_per_epoch is None and ran_any:
                    break  # the pass is over: so is the epoch
                raise self.loop.data_ended()
            ran_any = True
            with goodput.phase("step"):
                self.state = steps.run(self.state, [self._input.wrap(b) for b in batches])
                self._after_dispatch(cbs, len(batches))
            heartbeat.progress(self.loop.global_step)  # distrain launch --hang-timeout
            steps.calibrate(
                self.state,
                self.loop.global_step - self.loop.initial_step,
                [self.log_every, *(cb.step_interval for cb in cbs)],
            )
        return steps.epoch_logs(self.loop.global_step)

    def state_snapshot(self) -> Any:
        """A copy of the current state that later (donating) steps leave intact."""
        return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, self.state)

    def _after_dispatch(self, cbs: CallbackList, n: int) -> None:
        loop = self.loop
        before = loop.global_step
        loop.global_step += n
        loop.step_in_epoch += n
        logs = None
        if loop.global_step // self.log_every > before // self.log_every:
            assert self._steps is not None
            logs = self._steps.flush(loop.global_step)
        if cbs.listens("on_train_batch_end"):
            cbs.call(
                "on_train_batch_end",
                StepInfo(loop.global_step, loop.epoch, loop.step_in_epoch, n, logs, self.state),
            )

    # -------------------------------------------------------------- evaluate
    def evaluate(
        self,
        state: Any,
        data: Iterable[Any],
        *,
        steps: int | None = None,
        callbacks: Sequence[Callback] = (),
        _callbacks: CallbackList | None = None,
    ) -> dict[str, float]:
        """Runs ``eval_step`` over ``data`` (one pass, or ``steps`` batches).

        Metrics are accumulated on the devices and read once at the end.

        Returns:
          ``{metric: value}`` averaged over all real (unmasked) examples.

        Raises:
          ValueError: no ``eval_step``, or ``data`` yielded no batch.
        """
        if self._eval_fn is None:
            raise ValueError(
                "`Trainer.evaluate` needs an eval_step: pass Trainer(strategy, train_step, "
                "eval_step)."
            )
        steps = optional_positive_int("steps", steps)
        if steps is None:
            steps = steps_per_epoch_of(data)
        cbs = _callbacks or CallbackList([*self.callbacks, *callbacks], self)
        cbs.call("on_test_begin", None)
        with goodput.phase("evaluation"):
            state = self.strategy.put_replicated(state) if not self.loop.in_fit else state
            state = self.strategy.evaluation_state(state)
            batches = _input.distribute(self.strategy, data)
            logs = _inference.evaluate_loop(
                self.strategy, self._eval_fn, self._zeros, state, batches, steps
            )
        cbs.call("on_test_end", logs)
        return logs

    def predict(
        self,
        state: Any,
        data: Iterable[Any],
        *,
        steps: int | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> Any:
        """Runs ``predict_step`` over ``data`` and concatenates the outputs.

        Rows whose padding mask (``batch[mask_key]``) is 0 are dropped, so the result
        has one row per real example, in data order.

        Returns:
          The outputs' pytree with NumPy leaves of ``[num_examples, ...]``.

        Raises:
          ValueError: no ``predict_step``, or ``data`` yielded no batch.
        """
        if self._predict_fn is None:
            raise ValueError(
                "`Trainer.predict` needs a predict_step: pass Trainer(..., predict_step=fn)."
            )
        steps = optional_positive_int("steps", steps)
        if steps is None:
            steps = steps_per_epoch_of(data)
        cbs = CallbackList([*self.callbacks, *callbacks], self)
        cbs.call("on_predict_begin", None)
        state = self.strategy.evaluation_state(self.strategy.put_replicated(state))
        batches = _input.distribute(self.strategy, data)
        result = _inference.predict_loop(self.strategy, self._predict_fn, state, batches, steps)
        cbs.call("on_predict_end", None)
        return result
