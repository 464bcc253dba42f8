"""dt.metrics: sums and counts that stay exact across replicas and padded batches."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrain as dt
from distrain import Trainer
from distrain._src.train import metrics as M


def test_mean_with_mask_and_weights():
    m = M.Mean.from_values(jnp.array([1.0, 2.0, 9.0]), mask=jnp.array([1, 1, 0]))
    assert m.compute() == pytest.approx(1.5)
    w = M.Mean.from_values(jnp.array([1.0, 3.0]), sample_weight=jnp.array([3.0, 1.0]))
    assert w.compute() == pytest.approx(1.5)


def test_mask_broadcasts_over_trailing_axes():
    values = jnp.array([[1.0, 1.0], [5.0, 5.0]])
    m = M.Mean.from_values(values, mask=jnp.array([1.0, 0.0]))
    assert float(m.count) == 2.0 and m.compute() == pytest.approx(1.0)


def test_mask_of_higher_rank_is_an_error():
    with pytest.raises(ValueError, match="at most the rank"):
        M.Mean.from_values(jnp.ones(3), mask=jnp.ones((3, 2)))


def test_accuracy_and_sum():
    logits = jnp.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    acc = M.Accuracy.from_logits(logits, jnp.array([1, 1, 0]), mask=jnp.array([1, 1, 0]))
    assert acc.compute() == pytest.approx(0.5)
    assert M.Sum.from_values(jnp.array([1.0, 2.0]), mask=jnp.array([0, 1])).compute() == 2.0


def test_accuracy_shape_mismatch_error():
    with pytest.raises(ValueError, match="logits of shape"):
        M.Accuracy.from_logits(jnp.ones((4, 3)), jnp.ones((5,), jnp.int32))


def test_merge_adds_sums_and_rejects_other_types():
    a = M.Mean.from_values(jnp.array([1.0, 2.0]))
    b = M.Mean.from_values(jnp.array([6.0]))
    assert a.merge(b).compute() == pytest.approx(3.0)
    with pytest.raises(TypeError, match="same type"):
        a.merge(M.Sum.from_values(jnp.array([1.0])))


def test_mean_of_nothing_is_nan():
    m = M.Mean(total=jnp.zeros(()), count=jnp.zeros(()))
    assert math.isnan(m.compute())


def test_normalize_scalars_and_errors():
    out = M.normalize({"loss": jnp.float32(2.0), "lr": 0.1, "acc": M.Mean.from_scalar(1.0)})
    assert isinstance(out["loss"], M.Mean) and out["lr"].compute() == pytest.approx(0.1)
    with pytest.raises(TypeError, match="must be a scalar or a dt.metrics object"):
        M.normalize({"per_example": jnp.ones(4)})
    with pytest.raises(TypeError, match="must return metrics as a dict"):
        M.normalize([1.0])
    with pytest.raises(TypeError, match="names must be strings"):
        M.normalize({1: 1.0})


def test_metrics_are_pytrees_that_jit():
    f = jax.jit(lambda x: M.Accuracy.from_logits(x, jnp.array([0, 1])))
    acc = f(jnp.array([[1.0, 0.0], [1.0, 0.0]]))
    assert isinstance(acc, M.Accuracy) and acc.compute() == pytest.approx(0.5)


def test_padded_eval_mean_is_exact_over_replicas(devices):
    """13 rows, global batch 8 on 8 replicas: the last batch holds 5 real rows padded
    to 8, so 3 replicas see only padding. The mean must be over the 13 real rows."""
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    values = np.arange(13, dtype=np.float32) ** 2
    batches = [{"v": values[:8]}, {"v": values[8:]}]
    data = strategy.experimental_distribute_dataset(
        batches, dt.InputOptions(mask_key="mask", prefetch=0)
    )

    def eval_step(state, batch):
        return {
            "mean": M.Mean.from_values(batch["v"], mask=batch["mask"]),
            "n": M.Sum.from_values(batch["mask"]),
            # A plain scalar counts once per replica and step: 16 observations here.
            "plain": jnp.float32(1.0),
        }

    trainer = Trainer(strategy, lambda s, b: (s, {}), eval_step)
    logs = trainer.evaluate({"w": jnp.zeros(())}, data)
    assert logs["mean"] == pytest.approx(values.mean())
    assert logs["n"] == 13.0
    assert logs["plain"] == pytest.approx(1.0)


def test_a_metric_without_compute_cannot_be_created():
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class NoCompute(M.Metric):
        total: jax.Array

    with pytest.raises(TypeError, match="abstract method.*compute"):
        NoCompute(total=jnp.zeros(()))
