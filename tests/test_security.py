"""What a checkpoint may make distrain do when it is loaded (docs/security.md).

A checkpoint is data: arrays (orbax, tensorstore) and JSON, never a pickle. The one
name a checkpoint carries that distrain resolves is the class of each metric whose
epoch sums were saved mid-epoch; only a ``dt.metrics.Metric`` subclass is created.
"""

import numpy as np
import pytest

import distrain as dt
from distrain._src.train.progress import sums_from_json, sums_to_json

CALLS: list[dict] = []


def _record(**kwargs):
    """Not a metric: stands for any callable a tampered checkpoint might name."""
    CALLS.append(kwargs)


class _NotAMetric:
    def __init__(self, **kwargs):
        CALLS.append(kwargs)


def test_metric_sums_round_trip_through_json():
    metric = dt.metrics.Mean.from_values(np.asarray([1.0, 2.0, 4.0]))
    restored = sums_from_json({"loss": sums_to_json(metric)})["loss"]
    assert type(restored) is dt.metrics.Mean
    assert restored.compute() == pytest.approx(7.0 / 3.0)


@pytest.mark.parametrize("name", ["_record", "_NotAMetric", "CALLS"])
def test_a_checkpoint_naming_something_else_than_a_metric_is_refused_before_any_call(name):
    data = {"loss": {"type": f"{__name__}:{name}", "fields": {"total": [1.0]}}}
    with pytest.raises(ValueError, match=rf"metric 'loss' name '.*:{name}', which is not a dt"):
        sums_from_json(data)
    assert CALLS == []
