"""compute_average_loss / scale_regularization_loss: shapes, dtypes and arguments are
checked (TensorFlow/Keras semantics), and the result is computed in a float dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrain as dt

LOSS = jnp.array([1.0, 2.0, 3.0, 4.0])  # mean 2.5


def test_column_sample_weight_is_per_example_not_broadcast_to_a_matrix():
    w = jnp.array([1.0, 2.0, 3.0, 0.0])
    expected = float(jnp.sum(LOSS * w) / 4)  # 3.5
    got = dt.compute_average_loss(LOSS, sample_weight=w[:, None], global_batch_size=4)
    assert float(got) == pytest.approx(expected)
    got = dt.compute_average_loss(LOSS, sample_weight=w, global_batch_size=4)
    assert float(got) == pytest.approx(expected)


def test_column_mask_does_not_double_the_loss():
    m = jnp.array([1.0, 1.0, 0.0, 0.0])
    assert float(dt.compute_average_loss(LOSS, mask=m)) == pytest.approx(1.5)
    assert float(dt.compute_average_loss(LOSS, mask=m[:, None])) == pytest.approx(1.5)
    assert float(dt.compute_average_loss(LOSS, mask=m.astype(bool))) == pytest.approx(1.5)


def test_per_example_weight_on_a_per_token_loss():
    loss = jnp.ones((4, 3))
    w = jnp.array([1.0, 0.0, 1.0, 0.0])
    assert float(dt.compute_average_loss(loss, sample_weight=w)) == pytest.approx(1.5)
    assert float(dt.compute_average_loss(loss, sample_weight=2.0)) == pytest.approx(6.0)


def test_integer_and_boolean_losses_are_averaged_in_float():
    ints = jnp.array([1, 2, 3, 4], jnp.int32)
    out = dt.compute_average_loss(ints, sample_weight=jnp.array([0.5, 0.5, 0.5, 0.5]))
    assert out.dtype == jnp.float32 and float(out) == pytest.approx(1.25)
    bools = jnp.array([True, False, True, True])
    out = dt.compute_average_loss(bools)
    assert out.dtype == jnp.float32 and float(out) == pytest.approx(0.75)
    out = dt.compute_average_loss(bools, global_batch_size=8)
    assert float(out) == pytest.approx(3 / 8)


def test_low_precision_loss_keeps_its_dtype():
    out = dt.compute_average_loss(LOSS.astype(jnp.bfloat16), sample_weight=np.ones(4))
    assert out.dtype == jnp.bfloat16 and float(out) == pytest.approx(2.5)


def test_bad_shapes_and_dtypes_say_expected_and_received():
    with pytest.raises(ValueError, match=r"sample_weight.*shape \(3,\).*per_example_loss.*\(4,\)"):
        dt.compute_average_loss(LOSS, sample_weight=jnp.ones(3))
    with pytest.raises(ValueError, match=r"sample_weight.*shape \(4, 2\)"):
        dt.compute_average_loss(LOSS, sample_weight=jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=r"mask.*shape \(2,\).*\(4,\)"):
        dt.compute_average_loss(LOSS, mask=jnp.ones(2))
    with pytest.raises(ValueError, match=r"mask.*shape \(4, 3\).*\(4,\)"):
        dt.compute_average_loss(LOSS, mask=jnp.ones((4, 3)))
    with pytest.raises(TypeError, match=r"per_example_loss.*numeric.*complex64"):
        dt.compute_average_loss(LOSS.astype(jnp.complex64))
    with pytest.raises(TypeError, match=r"sample_weight.*numeric.*complex64"):
        dt.compute_average_loss(LOSS, sample_weight=jnp.ones(4, jnp.complex64))


@pytest.mark.parametrize("bad", [0, -4, np.int64(0)])
def test_global_batch_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"global_batch_size.*positive int.*Received"):
        dt.compute_average_loss(LOSS, global_batch_size=bad)


@pytest.mark.parametrize("bad", [True, False, 2.0, "8", np.float32(8)])
def test_a_global_batch_size_that_is_not_an_int_is_a_type_error(bad):
    """TF's compute_average_loss raises TypeError for a float global_batch_size
    (check_ops.assert_integer_v2, "global_batch_size must be an integer"): code that
    catches it keeps working."""
    with pytest.raises(TypeError, match=r"global_batch_size.*positive int.*Received"):
        dt.compute_average_loss(LOSS, global_batch_size=bad)


def test_numpy_int_global_batch_size_is_accepted():
    assert float(dt.compute_average_loss(LOSS, global_batch_size=np.int64(5))) == 2.0


def test_checks_hold_inside_strategy_run(devices):
    strategy = dt.MirroredStrategy()
    batch = strategy.distribute_batch(np.arange(16, dtype=np.float32))
    weights = strategy.distribute_batch(np.ones((16, 1), np.float32))
    out = strategy.run(
        lambda x, w: dt.compute_average_loss(x, sample_weight=w), args=(batch, weights)
    )
    assert float(strategy.reduce("sum", out)) == pytest.approx(np.arange(16).mean())


def test_scale_regularization_loss_float_and_sum_like_tf(devices):
    strategy = dt.MirroredStrategy()

    def fn():
        rid = dt.get_replica_context().replica_id_in_sync_group
        return (
            dt.scale_regularization_loss(jnp.bool_(True)) + 0 * rid,
            dt.scale_regularization_loss(jnp.int32(4)) + 0 * rid,
            # TF sums a list/vector of regularization losses (model.losses) first.
            dt.scale_regularization_loss([jnp.float32(1.0), jnp.float32(2.0)]) + 0 * rid,
        )

    b, i, lst = strategy.run(fn)
    assert float(strategy.reduce("sum", b)) == pytest.approx(1.0)
    assert float(strategy.reduce("sum", i)) == pytest.approx(4.0)
    assert float(strategy.reduce("sum", lst)) == pytest.approx(3.0)
    with pytest.raises(TypeError, match=r"regularization_loss.*numeric.*complex64"):
        dt.scale_regularization_loss(jnp.complex64(1.0))


def test_default_context_outside_any_strategy():
    assert float(dt.scale_regularization_loss(jnp.int32(3))) == 3.0
    assert jax.numpy.asarray(dt.scale_regularization_loss(jnp.int32(3))).dtype == jnp.float32
