"""Metrics as sums (``dt.metrics``): exact over replicas, steps and padded batches.

A metric is a pytree of totals; the Trainer adds them over replicas and steps on the
devices and calls ``compute()`` on the host.

Example:
  >>> def eval_step(state, batch):
  ...     logits = apply(state.params, batch["x"])
  ...     return {"accuracy": dt.metrics.Accuracy.from_logits(logits, batch["y"],
  ...                                                         mask=batch["mask"])}
"""

from distrain._src.train.metrics import Accuracy as Accuracy
from distrain._src.train.metrics import Mean as Mean
from distrain._src.train.metrics import Metric as Metric
from distrain._src.train.metrics import Sum as Sum
from distrain._src.train.metrics import WeightedMean as WeightedMean

__all__ = ["Accuracy", "Mean", "Metric", "Sum", "WeightedMean"]
