"""Loss helpers (TensorFlow semantics, exact partial-batch means) and input options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrain as dt


def test_compute_average_loss_divides_by_global_batch():
    loss = dt.compute_average_loss(jnp.array([1.0, 2.0, 3.0, 4.0, 5.0]), global_batch_size=10)
    assert float(loss) == 1.5


def test_compute_average_loss_default_is_per_replica_times_replicas(devices):
    strategy = dt.MirroredStrategy()
    batch = strategy.distribute_batch(np.arange(16, dtype=np.float32))
    out = strategy.run(lambda x: dt.compute_average_loss(x), args=(batch,))
    assert float(strategy.reduce("sum", out)) == pytest.approx(np.arange(16).mean())


def test_sample_weight():
    loss = dt.compute_average_loss(
        jnp.ones(4), sample_weight=jnp.array([1.0, 0, 1, 0]), global_batch_size=4
    )
    assert float(loss) == 0.5


def test_scale_regularization_loss_sums_back_to_original(devices):
    strategy = dt.MirroredStrategy()
    out = strategy.run(
        lambda: (
            dt.scale_regularization_loss(jnp.float32(3.0))
            + 0 * dt.get_replica_context().replica_id_in_sync_group
        )
    )
    assert float(strategy.reduce("sum", out)) == pytest.approx(3.0)


def test_partial_final_batch_gives_exact_mean_loss(devices):
    """20 examples, global batch 16: the last batch has 4 real rows padded to 16."""
    strategy = dt.MirroredStrategy()
    values = np.arange(20, dtype=np.float32)
    source = [{"v": values[:16]}, {"v": values[16:]}]
    ds = strategy.experimental_distribute_dataset(source, dt.InputOptions(mask_key="mask"))
    means = []
    for batch in ds:
        out = strategy.run(lambda b: dt.compute_average_loss(b["v"], mask=b["mask"]), args=(batch,))
        means.append(float(strategy.reduce("sum", out)))
    assert means == [pytest.approx(values[:16].mean()), pytest.approx(values[16:].mean())]


def test_drop_remainder(devices):
    strategy = dt.MirroredStrategy()
    source = [np.ones(16, np.float32), np.ones(8, np.float32)]
    batches = list(
        strategy.experimental_distribute_dataset(source, dt.InputOptions(drop_remainder=True))
    )
    assert len(batches) == 1


def test_prefetch_off_and_errors_propagate(devices):
    strategy = dt.MirroredStrategy()
    ds = strategy.experimental_distribute_dataset(
        [np.ones(8), np.ones(3)], dt.InputOptions(prefetch=0)
    )
    it = iter(ds)
    next(it)
    with pytest.raises(ValueError, match=r"global batch size \(3\)"):
        next(it)
    it = iter(strategy.experimental_distribute_dataset([np.ones(8), np.ones(3)]))
    next(it)
    with pytest.raises(ValueError, match=r"global batch size \(3\)"):
        next(it)


def test_compute_average_loss_errors(devices):
    with pytest.raises(ValueError, match="Received a scalar"):
        dt.compute_average_loss(jnp.float32(1.0))
    with pytest.raises(ValueError, match="positive int.*Received: 0"):
        dt.compute_average_loss(jnp.ones(2), global_batch_size=0)
    with dt.MirroredStrategy().scope():
        with pytest.raises(RuntimeError, match="cross-replica context"):
            dt.compute_average_loss(jnp.ones(2))


def test_input_options_errors(devices):
    strategy = dt.MirroredStrategy()
    with pytest.raises(ValueError, match="prefetch.*-1"):
        dt.InputOptions(prefetch=-1)
    with pytest.raises(TypeError, match="iterable of batches"):
        strategy.experimental_distribute_dataset(42)
    with pytest.raises(TypeError, match="mask_key.*needs dict batches"):
        next(
            iter(
                strategy.experimental_distribute_dataset(
                    [np.ones(8)], dt.InputOptions(mask_key="m", prefetch=0)
                )
            )
        )
    with pytest.raises(TypeError, match="cannot save its position"):
        iter(strategy.experimental_distribute_dataset([np.ones(8)])).get_state()


class _Resumable:
    """A source with get_state/set_state, like ArrayPipeline's iterator."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return np.full(8, self.i, np.float32)

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def test_iterator_state_counts_consumed_batches_not_prefetched(devices):
    strategy = dt.MirroredStrategy()
    it = iter(strategy.experimental_distribute_dataset(_Resumable(), dt.InputOptions(prefetch=3)))
    for _ in range(2):
        next(it)
    state = it.get_state()
    assert state == {"i": 2}
    expected = float(strategy.gather(next(it))[0])
    it.set_state(state)
    assert float(strategy.gather(next(it))[0]) == expected == 3.0


def test_jax_arrays_as_batches(devices):
    strategy = dt.MirroredStrategy()
    batch = next(iter(strategy.experimental_distribute_dataset([jnp.arange(8.0)])))
    assert jax.tree.leaves(batch)[0].sharding.spec == jax.sharding.PartitionSpec("replica")
