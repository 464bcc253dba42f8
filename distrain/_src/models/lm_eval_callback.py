"""``dt.models.LMEvalCallback``: lm-evaluation-harness tasks on the state during ``fit``.

Every ``every`` epochs, :meth:`LMEvalModel.evaluate` runs the tasks on the trainer's
current parameters (``trainer.state.params``: the training's own layout, nothing
copied or gathered) through the trainer's strategy, and adds each task's metrics to the
epoch's logs as ``lm_eval/<task>/<metric>`` (a filter other than ``none`` is appended:
``exact_match_flexible-extract``), so the loggers listed after it (TensorBoard, CSV,
W&B, MLflow) record them. Every process runs the requests (the programs are
collective); the metrics are added on process 0, where the loggers write.

Example:
  >>> lm = dt.models.LMEvalModel(model, state.params, "bytes", strategy=strategy)
  >>> cb = dt.models.LMEvalCallback(lm, ["my_task"], include_path="tasks/", limit=200)
  >>> trainer.fit(state, data, epochs=3, callbacks=[cb, dt.callbacks.CSVLogger("log.csv")])
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from distrain._src.models.lm_eval import LMEvalModel
from distrain._src.train.callbacks.base import Callback, Logs

__all__ = ["LMEvalCallback", "task_metrics"]


class LMEvalCallback(Callback):
    """Evaluates lm-eval ``tasks`` on the trainer's state every ``every`` epochs.

    Args:
      lm: the :class:`LMEvalModel` (its module, tokenizer and strategy; its parameters
        are replaced by the state's for each evaluation).
      tasks: lm-eval task names.
      every: epochs between evaluations (after epochs ``every - 1``, ``2 * every - 1``...).
      prefix: of the metrics' names in the logs.
      **kwargs: :meth:`LMEvalModel.evaluate`'s (``include_path``, ``limit``,
        ``num_fewshot``, ``bootstrap_iters``, ...).

    Attributes:
      results: ``(epoch, metrics)`` of each evaluation, on process 0.
    """

    def __init__(self, lm: LMEvalModel, tasks: Sequence[str], *, every: int = 1,
                 prefix: str = "lm_eval/", **kwargs: Any) -> None:  # fmt: skip
        if not isinstance(lm, LMEvalModel):
            raise TypeError(
                "LMEvalCallback's lm must be a dt.models.LMEvalModel. Received: "
                f"{type(lm).__name__}."
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"LMEvalCallback's every must be an int >= 1. Received: {every!r}.")
        self.lm, self.tasks, self.every, self.prefix = lm, list(tasks), every, prefix
        self.kwargs = kwargs
        self.results: list[tuple[int, dict[str, float]]] = []

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if (epoch + 1) % self.every:
            return
        params = self._fit_trainer.state.params
        results = self.lm.evaluate(self.tasks, params=params, **self.kwargs)
        if results is None:  # not process 0
            return
        metrics = {self.prefix + k: v for k, v in task_metrics(results).items()}
        self.results.append((epoch, metrics))
        if isinstance(logs, MutableMapping):
            logs.update(metrics)


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` of ``lm_eval.simple_evaluate``'s results: every
    metric but the standard errors (``acc,none`` -> ``acc``; ``exact_match,strict`` ->
    ``exact_match_strict``).

    Example:
      >>> task_metrics({"results": {"t": {"acc,none": 0.5, "acc_stderr,none": 0.1}}})
      {'t/acc': 0.5}
    """
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            name, comma, kind = key.partition(",")  # "metric,filter"; others are not metrics
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if comma and number and "_stderr" not in name:
                out[f"{task}/{name if kind == 'none' else f'{name}_{kind}'}"] = float(value)
    return out
