"""Smoke test of examples/custom_training_loop: the TF guide's loop (strategy.run,
compute_average_loss, strategy.reduce) on 8 replicas, a few steps."""

import jax
import numpy as np

from examples.custom_training_loop.train import run


def test_custom_loop_few_steps(devices):
    logs = []
    out = run(epochs=2, max_steps_per_epoch=6, log=logs.append)
    assert logs[0] == "Number of devices: 8"
    assert len(out["losses"]) == 2 and out["losses"][1] < out["losses"][0]
    assert out["test_count"] == 359  # every test image once: the padded rows are masked
    assert 0.3 < out["test_accuracy"] <= 1.0
    assert int(out["state"].step) == 12
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(out["state"].params))
