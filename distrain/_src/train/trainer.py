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

Size: ~650 lines, over the house's ~500 on purpose. ``fit`` is one state machine
(epochs, dispatches, the metric window, validation, resume) over one loop record;
the parts that stand alone already live elsewhere (``_functions``: the compiled step
wrappers; ``_inference``: evaluate and predict; ``progress``: passes and positions;
``_input``: device-resident data), and splitting the rest would spread the loop's
state over modules that all write it.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from distrain._src.current import get_strategy
from distrain._src.padding import MASK_KEY
from distrain._src.strategy.base import Strategy
from distrain._src.train import _functions as F
from distrain._src.train import _inference, _input
from distrain._src.train.accumulation import accumulate_gradients
from distrain._src.train.callbacks.base import Callback, CallbackList, StepInfo
from distrain._src.train.callbacks.control import TerminateOnNaN
from distrain._src.train.history import History
from distrain._src.train.metrics import Metric
from distrain._src.train.progress import (
    DataEndedError,
    LoopState,
    PassIterator,
    steps_per_epoch_of,
    sums_from_json,
    sums_to_json,
)
from distrain._src.validate import optional_positive_int, positive_int

__all__ = ["DataEndedError", "Trainer"]


# steps_per_execution="auto": one dispatch should keep the devices busy this long, so
# that per-dispatch host time (tens of microseconds) is under 1% of it.
_TARGET_DISPATCH_SECONDS = 0.004
_CALIBRATION_STEPS = 4
_MAX_AUTO_STEPS = 64


def auto_steps_per_execution(seconds_per_step: float, cap: int) -> int:
    """The power of two of steps that makes one dispatch last ``_TARGET_DISPATCH_SECONDS``.

    Powers of two keep the number of compiled programs small; the result is at most
    ``cap`` (and ``_MAX_AUTO_STEPS``) and at least 1.

    Example:
      >>> auto_steps_per_execution(0.0001, cap=100)   # 0.1 ms steps: 40 wanted
      64
    """
    want = max(1, math.ceil(_TARGET_DISPATCH_SECONDS / max(seconds_per_step, 1e-9)))
    k = 1 << (want - 1).bit_length()
    while k > min(cap, _MAX_AUTO_STEPS):
        k //= 2
    return max(1, k)


def _check_strategy(strategy: Any) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    from distrain._src.ps.strategy import ParameterServerStrategy

    if isinstance(strategy, ParameterServerStrategy):
        raise TypeError(
            "The Trainer runs synchronous strategies; ParameterServerStrategy trains "
            "asynchronously through a coordinator: "
            "`coordinator = dt.experimental.coordinator.ClusterCoordinator(strategy)`, then "
            "`coordinator.schedule(step, args=(...))` and `coordinator.join()` "
            "(docs/parameter_server.md). For the Trainer use dt.MirroredStrategy() or "
            "dt.MultiWorkerMirroredStrategy()."
        )
    raise TypeError(
        "`strategy` must be a distrain strategy (a dt.Strategy such as dt.MirroredStrategy()). "
        f"Received: {strategy!r}."
    )


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
    ) -> None:
        self.strategy = _check_strategy(strategy if strategy is not None else get_strategy())
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
        self.steps_per_execution = (
            1 if self._auto_k else positive_int("steps_per_execution", steps_per_execution)
        )
        self.log_every = positive_int("log_every", log_every)
        self.mask_key = mask_key
        self._donate = (0,) if donate_state else ()
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
        self._acc: Any = None
        self._zero_acc: Any = None
        self._layout: F.Layout | None = None
        self._window_steps = 0
        self._epoch_sums: dict[str, Metric] | None = None
        self._passes: PassIterator | None = None
        self._cbs: CallbackList | None = None
        self._calibration: float | None = None
        self._resident: _input.Resident | None = None
        self._fit_step = self._step_fn
        self.input_mode: str | None = None
        self._warned_not_finite = False

    def progress(self) -> dict[str, Any]:
        """The loop position as JSON-compatible data, for checkpoints.

        Reads the on-device metric accumulator first (a host sync), so the saved
        epoch metrics are complete. ``"callbacks"`` holds each callback's
        ``state_dict()`` (those that have one) by ``state_key``. ``BackupAndRestore``
        saves this and hands it back to :meth:`resume`.
        """
        self._flush_window()
        done = self._epoch_done
        sums = None
        if not done and self._epoch_sums is not None:
            sums = {k: sums_to_json(m) for k, m in self._epoch_sums.items()}
        return {
            "epoch": self.loop.epoch + 1 if done else self.loop.epoch,
            "step_in_epoch": 0 if done else self.loop.step_in_epoch,
            "global_step": self.loop.global_step,
            "history": self.loop.history.to_dict(),
            "epoch_sums": sums,
            "callbacks": self._callback_states(),
        }

    def _callback_states(self) -> dict[str, Any]:
        states = {}
        for cb in self._cbs or ():
            state = cb.state_dict()
            if state is not None:
                states[cb.state_key] = state
        return states

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
        if not self.loop.in_fit or self._passes is None:
            raise RuntimeError("`Trainer.resume` can only be called during fit (on_train_begin).")
        self.state = state
        self.loop.epoch = self.loop.initial_epoch = int(progress["epoch"])
        self.loop.global_step = self.loop.initial_step = int(progress["global_step"])
        self.loop.step_in_epoch = int(progress.get("step_in_epoch", 0))
        self.loop.history = History.from_dict(progress.get("history") or {})
        sums = progress.get("epoch_sums")
        self._resumed_sums = sums_from_json(sums) if sums else None
        self._passes.restore(data_state, self.loop.step_in_epoch)
        states = progress.get("callbacks") or {}
        for cb in self._cbs or ():
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])

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
        # In-memory data that fits goes to the devices once; steps then read row ids.
        self.input_mode, self._resident = _input.choose(self.strategy, data, self._input_mode)
        step_fn = self._step_fn
        if self._resident is not None:
            data = self._resident.index_pipeline()
            step_fn = self._resident.gathering(step_fn)
        self._fit_step = step_fn
        dist = _inference.distribute(self.strategy, data)
        self.loop.epochs, self.loop.steps = epochs, steps
        self.loop.steps_per_epoch = (
            positive_int("steps_per_epoch", steps_per_epoch)
            if steps_per_epoch is not None
            else steps_per_epoch_of(data)
        )
        if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int | np.integer):
            raise TypeError(f"`initial_epoch` must be an int. Received: {initial_epoch!r}.")
        if initial_epoch < 0:
            raise ValueError(
                f"`initial_epoch` must be >= 0 (epochs count from 0). Received: {initial_epoch}."
            )
        self.loop.epoch = self.loop.initial_epoch = int(initial_epoch)
        self.loop.global_step = self.loop.initial_step = initial_epoch * (
            self.loop.steps_per_epoch or 0
        )
        self.loop.has_validation = validation_data is not None
        if self._auto_k:
            self.steps_per_execution, self._calibration = 1, 0.0
        self.state = self.strategy.put_replicated(state)  # a copy: donation spares `state`
        self._passes = PassIterator(dist, self.loop.steps_per_epoch)
        self._resumed_sums = None
        cbs = self._cbs = CallbackList([*self.callbacks, *callbacks], self)
        _check_state_keys(cbs)
        self.loop.in_fit = True
        try:
            cbs.call("on_train_begin", None)
            logs: dict[str, float] = {}
            while not self._finished():
                logs = self._run_epoch(cbs)
                # Absolute epoch numbers, so a resumed run validates after the same epochs.
                if validation_data is not None and (self.loop.epoch + 1) % validation_freq == 0:
                    val = self.evaluate(
                        self.state, validation_data, steps=validation_steps, _callbacks=cbs
                    )
                    logs.update({f"val_{k}": v for k, v in val.items()})
                self.loop.history.append(self.loop.epoch, logs)
                self._epoch_done = True
                cbs.call("on_epoch_end", self.loop.epoch, logs)
                self._epoch_done = False
                self.loop.epoch += 1
                self.loop.step_in_epoch = 0
                if self.stop_training:
                    break
            cbs.call("on_train_end", logs)
        except BaseException as e:
            cbs.abort(e)
            raise
        finally:
            self.loop.in_fit = False
        return self.state, self.loop.history

    def _finished(self) -> bool:
        if self.stop_training:
            return True
        if self.loop.epochs is not None and self.loop.epoch >= self.loop.epochs:
            return True
        return self.loop.steps is not None and self.loop.global_step >= self.loop.steps

    def _steps_left_in_epoch(self) -> float:
        """Steps before the epoch or the run ends (``math.inf`` when neither is bounded)."""
        left: float = math.inf
        if self.loop.steps_per_epoch is not None:
            left = self.loop.steps_per_epoch - self.loop.step_in_epoch
        if self.loop.steps is not None:
            left = min(left, self.loop.steps - self.loop.global_step)
        return left

    def _run_epoch(self, cbs: CallbackList) -> dict[str, float]:
        """Runs one epoch's steps; returns the epoch's training metrics."""
        assert self._passes is not None
        cbs.call("on_epoch_begin", self.loop.epoch, None)
        if self.loop.steps_per_epoch is None:
            self._passes.begin_epoch()
        self._epoch_sums, self._resumed_sums = self._resumed_sums, None
        ran_any = self.loop.step_in_epoch > 0
        while not self.stop_training:
            want = min(self.steps_per_execution, self._steps_left_in_epoch())
            if want <= 0:
                break
            batches = self._passes.take(
                int(want), new_pass_ok=self.loop.steps_per_epoch is not None
            )
            if not batches:
                if self.loop.steps_per_epoch is None and ran_any:
                    break  # the pass is over: so is the epoch
                raise DataEndedError(self._data_ended_message())
            ran_any = True
            self._dispatch(batches)
            self._after_dispatch(cbs, len(batches))
            if self._calibration is not None:
                self._calibrate(cbs)
        return self._epoch_logs()

    def _calibrate(self, cbs: CallbackList) -> None:
        """``steps_per_execution="auto"``: time single steps, then fuse enough of them.

        The first dispatch compiles; the clock covers the next ``_CALIBRATION_STEPS``
        (two host syncs in all, once per fit).
        """
        done = self.loop.global_step - self.loop.initial_step
        if done == 1:
            jax.block_until_ready(self.state)
            self._calibration = time.perf_counter()
        elif done == 1 + _CALIBRATION_STEPS and self._calibration is not None:
            jax.block_until_ready(self.state)
            per_step = (time.perf_counter() - self._calibration) / _CALIBRATION_STEPS
            caps = [self.log_every, *(cb.step_interval for cb in cbs)]
            self.steps_per_execution = auto_steps_per_execution(
                per_step, min(c for c in caps if c is not None)
            )
            self._calibration = None

    def _data_ended_message(self) -> str:
        if self.loop.steps is not None:
            wanted = f"steps={self.loop.steps}"
        elif self.loop.steps_per_epoch is not None:
            wanted = f"{self.loop.epochs} epochs x {self.loop.steps_per_epoch} steps"
        else:
            wanted = f"epochs={self.loop.epochs} (epoch {self.loop.epoch} got no batch)"
        return (
            f"The training data ended after {self.loop.global_step} steps, but fit asked for "
            f"{wanted}. Make the dataset repeat (e.g. ArrayPipeline(num_epochs=None)), pass "
            "a re-iterable dataset instead of a one-shot iterator, or ask for fewer steps."
        )

    def _dispatch(self, batches: list[Any]) -> None:
        if self._resident is not None:
            batches = [self._resident.batch(b) for b in batches]
        if self._acc is None:
            shapes = F.trace_shapes(
                self.strategy, F.make_metrics_fn(self._fit_step), (self.state, batches[0])
            )
            self._layout = F.Layout(shapes)
            self._zero_acc = F.per_replica_zeros(self.strategy, self._layout.size)
            self._acc = self._zero_acc
        k = self.steps_per_execution
        groups = [batches] if len(batches) == k else [[b] for b in batches]
        first = self.loop.global_step == self.loop.initial_step
        for group in groups:
            fn = F.make_train_fn(self._fit_step, len(group))
            self.state, self._acc = self.strategy.run(
                fn, args=(self.state, self._acc, *group), donate_argnums=self._donate
            )
        if first:
            self._warn_if_state_varies()

    def state_snapshot(self) -> Any:
        """A copy of the current state that later (donating) steps leave intact."""
        return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, self.state)

    def _warn_if_state_varies(self) -> None:
        from distrain._src.values import PerReplica

        varying = [
            jax.tree_util.keystr(p)
            for p, x in jax.tree_util.tree_leaves_with_path(
                self.state, is_leaf=lambda x: isinstance(x, PerReplica)
            )
            if isinstance(x, PerReplica)
        ]
        if varying:
            warnings.warn(
                f"train_step returned a state whose leaves {varying[:5]} differ across "
                "replicas (they came back as dt.PerReplica). Replicas then train different "
                "models. All-reduce what must agree (state.apply_gradients does it for "
                "gradients; use dt.get_replica_context().all_reduce for statistics).",
                stacklevel=3,
            )

    def _after_dispatch(self, cbs: CallbackList, n: int) -> None:
        loop = self.loop
        before = loop.global_step
        loop.global_step += n
        loop.step_in_epoch += n
        self._window_steps += n
        logs = None
        if loop.global_step // self.log_every > before // self.log_every:
            logs = self._flush_window()
        if cbs.listens("on_train_batch_end"):
            cbs.call(
                "on_train_batch_end",
                StepInfo(loop.global_step, loop.epoch, loop.step_in_epoch, n, logs, self.state),
            )

    # ---------------------------------------------------------- metric sums
    def _flush_window(self) -> dict[str, float] | None:
        """Reads the device accumulator (host sync), folds it into the epoch sums."""
        if self._acc is None or self._layout is None or self._window_steps == 0:
            return None
        host = self._layout.unpack(jax.device_get(self.strategy.reduce("sum", self._acc)))
        self._acc = self._zero_acc
        self._window_steps = 0
        if self._epoch_sums is None:
            self._epoch_sums = host
        else:
            self._epoch_sums = {k: self._epoch_sums[k].merge(host[k]) for k in host}
        logs = {k: m.compute() for k, m in host.items()}
        self._warn_if_not_finite(logs)
        return logs

    def _warn_if_not_finite(self, logs: dict[str, Any]) -> None:
        """Warns once per fit when a metric turns NaN/inf and nothing else will say so."""
        if self._warned_not_finite or any(isinstance(cb, TerminateOnNaN) for cb in self._cbs or ()):
            return
        bad = {k: v for k, v in logs.items() if np.ndim(v) == 0 and not np.isfinite(v)}
        if bad:
            self._warned_not_finite = True
            warnings.warn(
                f"Training metrics are not finite at step {self.loop.global_step}: {bad}. The "
                "state is probably NaN from here on; add dt.callbacks.TerminateOnNaN() to stop "
                "fit at the first non-finite metric (checkpoints then keep the last good step).",
                RuntimeWarning,
                stacklevel=2,
            )

    def _epoch_logs(self) -> dict[str, float]:
        self._flush_window()
        return {k: m.compute() for k, m in (self._epoch_sums or {}).items()}

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
        state = self.strategy.put_replicated(state) if not self.loop.in_fit else state
        batches = _inference.distribute(self.strategy, data)
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
        state = self.strategy.put_replicated(state)
        batches = _inference.distribute(self.strategy, data)
        result = _inference.predict_loop(self.strategy, self._predict_fn, state, batches, steps)
        cbs.call("on_predict_end", None)
        return result


def _check_state_keys(callbacks: Iterable[Callback]) -> None:
    """Callbacks that save a state with checkpoints need distinct ``state_key``s: two
    under one key would overwrite each other (and resume into one another's state)."""
    seen: dict[str, Callback] = {}
    for cb in callbacks:
        if type(cb).state_dict is Callback.state_dict:
            continue  # saves nothing
        if cb.state_key in seen:
            raise ValueError(
                f"Two callbacks save their state under the key {cb.state_key!r}: "
                f"{seen[cb.state_key]!r} and {cb!r}. Give one a distinct `state_key` "
                "(override the property) so that a resumed fit restores each its own."
            )
        seen[cb.state_key] = cb
