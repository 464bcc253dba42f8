"""What the distributed dataset accepts as a batch, and what its errors tell you to do."""

import numpy as np
import optax
import pytest

import distrain as dt


def _first(strategy, source, options=None):
    return next(iter(strategy.experimental_distribute_dataset(source, options)))


def _all(strategy, source, options=None):
    return list(strategy.experimental_distribute_dataset(source, options))


# ------------------------------------------------------- batch sizes and replicas (item 9)


def test_full_batch_not_divisible_suggests_a_divisible_size_not_mask_key(devices):
    strategy = dt.MirroredStrategy()
    with pytest.raises(
        ValueError, match=r"global batch size \(12\).*number of replicas \(8\).*8 or 16"
    ) as e:
        _first(strategy, [np.ones(12)])
    assert "mask_key" not in str(e.value) and "drop_remainder" not in str(e.value)


def test_short_last_batch_suggests_what_actually_helps(devices):
    strategy = dt.MirroredStrategy()
    dicts = [{"v": np.ones(16)}, {"v": np.ones(5)}]
    with pytest.raises(ValueError, match=r"last global batch size \(5\).*first \(16\)") as e:
        _all(strategy, dicts)
    msg = str(e.value)
    assert "drop_remainder=True" in msg and "mask_key=" in msg
    # Both suggestions are true: each makes the same data go through.
    assert len(_all(strategy, dicts, dt.InputOptions(drop_remainder=True))) == 1
    padded = _all(strategy, dicts, dt.InputOptions(mask_key="mask"))
    mask = np.asarray(strategy.gather(padded[1])["mask"])
    assert mask.shape == (16,) and mask.sum() == 5.0
    # mask_key needs dict batches: for arrays only drop_remainder is suggested.
    with pytest.raises(ValueError, match=r"last global batch size \(5\)") as e:
        _all(strategy, [np.ones(16), np.ones(5)])
    assert "drop_remainder=True" in str(e.value) and "mask_key" not in str(e.value)


# ------------------------------------------------------------------- bad batches (item 8)


def test_zero_row_batch_is_refused(devices):
    strategy = dt.MirroredStrategy()
    with pytest.raises(ValueError, match=r"batch has no rows.*leading dimension 0"):
        _first(strategy, [{"x": np.ones((0, 3)), "y": np.ones(0)}])
    with pytest.raises(ValueError, match=r"batch has no rows"):
        _all(strategy, [np.ones(8), np.ones(0)])


def test_later_batch_larger_than_the_first_with_a_mask(devices):
    strategy = dt.MirroredStrategy()
    source = [{"v": np.ones(8)}, {"v": np.ones(16)}]
    with pytest.raises(ValueError, match=r"16 rows, more than the first batch \(8\).*mask_key"):
        _all(strategy, source, dt.InputOptions(mask_key="mask"))
    # Without a mask a larger batch is fine (the step recompiles for the new shape).
    assert len(_all(strategy, source)) == 2


@pytest.mark.parametrize(
    "value, kind",
    [
        (np.array(["a", "b"] * 4), "<U1"),
        (np.array([object()] * 8), "object"),
        (np.array([b"x"] * 8), "|S1"),
    ],
)
def test_string_and_object_arrays_name_the_key(devices, value, kind):
    strategy = dt.MirroredStrategy()
    with pytest.raises(TypeError, match=rf"\['name'\].*dtype {kind}.*numeric"):
        _first(strategy, [{"x": np.ones(8), "name": value}])


def test_bfloat16_and_bool_batches_are_fine(devices):
    import jax.numpy as jnp

    strategy = dt.MirroredStrategy()
    batch = _first(strategy, [{"x": np.ones(8, jnp.bfloat16), "m": np.ones(8, bool)}])
    assert strategy.gather(batch)["x"].dtype == jnp.bfloat16


# ------------------------------------------------------------ whole arrays instead of batches


def _trainer(strategy):
    def step(state, batch):
        return state, {"n": batch[0].shape[0] if isinstance(batch, tuple) else 0}

    return dt.Trainer(strategy, step)


def _state():
    return dt.TrainState.create(params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))


def test_fit_on_a_dict_of_whole_arrays_says_how_to_batch_them(devices):
    strategy = dt.MirroredStrategy()
    x, y = np.ones((100, 3), np.float32), np.ones(100, np.int32)
    with pytest.raises(
        TypeError, match=r"dict of arrays: wrap it as dt.data.ArrayPipeline\(.*100 rows"
    ):
        _trainer(strategy).fit(_state(), {"x": x, "y": y})


def test_fit_on_a_keras_style_tuple_says_how_to_batch_it(devices):
    strategy = dt.MirroredStrategy()
    x, y = np.ones((100, 3), np.float32), np.ones(100, np.int32)
    with pytest.raises(
        TypeError, match=r"tuple of 2 whole arrays.*\(x, y\).*ArrayPipeline\(\(x, y\)"
    ):
        _trainer(strategy).fit(_state(), (x, y))
    with pytest.raises(TypeError, match=r"tuple of 2 whole arrays"):
        strategy.experimental_distribute_dataset((x, y))
    with pytest.raises(TypeError, match=r"an array of 100 rows.*ArrayPipeline\("):
        strategy.experimental_distribute_dataset(x)


def test_tuple_batches_reach_the_step_as_tuples(devices):
    strategy = dt.MirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0], np.float32)).astype(np.float32)
    seen = []

    def step(state, batch):
        seen.append(type(batch).__name__)
        xb, yb = batch

        def loss_fn(p):
            return dt.compute_average_loss((xb @ p["w"] - yb) ** 2)

        import jax

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    data = dt.data.ArrayPipeline((x, y), global_batch_size=32, seed=0)
    _, history = dt.Trainer(strategy, step).fit(_state(), data, epochs=3)
    assert set(seen) == {"tuple"}
    losses = history.history["loss"]
    assert losses[-1] < losses[0] / 2


def test_short_last_batch_of_an_array_pipeline_names_its_own_options(devices):
    strategy = dt.MirroredStrategy()
    x, y = np.ones((60, 2), np.float32), np.ones(60, np.int32)
    tuples = dt.data.ArrayPipeline((x, y), global_batch_size=16, num_epochs=1, drop_remainder=False)
    with pytest.raises(
        ValueError,
        match=r"last global batch size \(12\).*first \(16\).*"
        r"ArrayPipeline\(\.\.\., drop_remainder=True\).*mask_key needs dict data",
    ):
        _all(strategy, tuples)
    dicts = dt.data.ArrayPipeline(
        {"x": x}, global_batch_size=16, num_epochs=1, drop_remainder=False
    )
    with pytest.raises(ValueError, match=r"ArrayPipeline\(\.\.\., mask_key='mask'\)"):
        _all(strategy, dicts)
    # What the message says works.
    fixed = dt.data.ArrayPipeline(
        {"x": x}, global_batch_size=16, num_epochs=1, drop_remainder=False, mask_key="mask"
    )
    assert len(_all(strategy, fixed)) == 4
