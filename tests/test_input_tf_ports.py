"""TensorFlow's distributed-input tests, re-stated against distrain (issue 23).

Each test names the TF test it ports (``tensorflow/python/distribute/input_lib_test.py``,
``custom_training_loop_input_test.py``), or the bad input it pins.
"""

import numpy as np
import pytest

import distrain as dt

PER_REPLICA = dt.InputOptions(per_replica_batches=True)


def _local(strategy, value):
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def test_a_batch_of_tuples_unpacks_into_per_replica_values(devices):
    """input_lib_test.py ``testTupleDataset`` (batched): ``x, y = next(iterator)`` gives
    two per-replica values, each split as the batch is."""
    strategy = dt.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    data = [(np.arange(2.0 * n), np.arange(2.0 * n) ** 2)]
    x, y = next(iter(strategy.experimental_distribute_dataset(data)))
    assert isinstance(x, dt.PerReplica) and isinstance(y, dt.PerReplica)
    assert _local(strategy, x)[1] == [2.0, 3.0] and _local(strategy, y)[1] == [4.0, 9.0]
    total = strategy.run(lambda a, b: a + b, args=(x, y))
    np.testing.assert_array_equal(strategy.gather(total), data[0][0] + data[0][1])
    # Dict batches index by key into per-replica values, as TF's dict elements do.
    batch = next(iter(strategy.experimental_distribute_dataset([{"x": np.arange(2.0 * n)}])))
    assert _local(strategy, batch["x"])[0] == [0.0, 1.0]


def test_a_per_replica_value_that_is_not_a_sequence_does_not_unpack(devices):
    strategy = dt.MirroredStrategy()
    batch = next(iter(strategy.experimental_distribute_dataset([{"x": np.zeros(8)}])))
    with pytest.raises(TypeError, match=r"tuple or list unpacks.*holds a dict.*batch\['x'\]"):
        x, y = batch
    array = next(iter(strategy.experimental_distribute_dataset([np.zeros(8)])))
    with pytest.raises(TypeError, match=r"tuple, list or dict can be indexed.*holds a"):
        array[0]


def test_unbatched_tuples_from_a_function_go_one_per_replica(devices):
    """input_lib_test.py ``testTupleDataset`` (``dataset_fn`` of unbatched
    ``zip(range(10), range(10)**2)``): each replica gets one element ``(i, i**2)``."""
    strategy = dt.MirroredStrategy(devices=devices[:2])

    def dataset_fn(ctx):
        return [(np.int32(i), np.int32(i**2)) for i in range(10)]

    steps = list(strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA))
    assert len(steps) == 5
    for s, (x, y) in enumerate(steps):
        i = 2 * s
        assert _local(strategy, x) == [i, i + 1] and _local(strategy, y) == [i**2, (i + 1) ** 2]
    doubled = strategy.run(lambda a, b: a * 2 + b, args=tuple(steps[1]))
    assert _local(strategy, doubled) == [2 * 2 + 4, 3 * 2 + 9]


def test_unbatched_scalars_from_a_function(devices):
    """custom_training_loop_input_test.py ``testDistributeDatasetIteratorWithoutFunction``:
    the first step's local results are ``data[0:num_replicas_in_sync]``."""
    strategy = dt.MirroredStrategy()
    data = [float(v) for v in range(16)]
    it = iter(
        strategy.distribute_datasets_from_function(
            lambda _: [np.float32(v) for v in data], PER_REPLICA
        )
    )
    assert _local(strategy, next(it)) == data[:8]
    assert float(strategy.reduce("sum", next(it))) == sum(data[8:])


def test_a_short_last_group_of_elements_is_dropped_only_when_asked(devices):
    """input_lib_test.py ``testUnevenDatasetBatches`` (``range(11)`` on 2 devices: the
    odd element is not given to one replica alone)."""
    strategy = dt.MirroredStrategy(devices=devices[:2])

    def dataset_fn(ctx):
        return [np.int64(i) for i in range(11)]

    dropped = strategy.distribute_datasets_from_function(
        dataset_fn, dt.InputOptions(per_replica_batches=True, drop_remainder=True)
    )
    assert [_local(strategy, b) for b in dropped] == [[i, i + 1] for i in range(0, 10, 2)]
    with pytest.raises(ValueError, match=r"last step has 1 element.*2 replicas.*drop_remainder"):
        list(strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA))
    with pytest.raises(ValueError, match=r"mask_key=...\) pads partial batches.*no rows to pad"):
        list(
            strategy.distribute_datasets_from_function(
                dataset_fn, dt.InputOptions(per_replica_batches=True, mask_key="mask")
            )
        )


def test_elements_of_different_shapes_are_named(devices):
    strategy = dt.MirroredStrategy(devices=devices[:2])
    elements = [{"x": np.float32(0), "y": np.zeros(3)}, {"x": np.float32(1), "y": np.zeros(4)}]
    with pytest.raises(ValueError, match=r"Leaf \['y'\] has shapes \[\(3,\), \(4,\)\]"):
        next(iter(strategy.distribute_datasets_from_function(lambda _: elements, PER_REPLICA)))
    mixed = [(np.float32(0), np.float32(1)), (np.float32(0),)]
    with pytest.raises(ValueError, match=r"must have one structure to go one per replica"):
        next(iter(strategy.distribute_datasets_from_function(lambda _: mixed, PER_REPLICA)))


def test_unbatched_elements_without_the_option_say_what_to_do(devices):
    """Was: "Every leaf of a batch must have the same leading (batch) dimension.
    Received shapes: {'': ()}" for one scalar leaf."""
    strategy = dt.MirroredStrategy()
    with pytest.raises(
        ValueError,
        match=r"Batch leaf \(the batch itself\) has no batch "
        r"dimension \(shape \(\)\).*per_replica_batches=True",
    ):
        next(
            iter(
                strategy.distribute_datasets_from_function(
                    lambda _: [np.float32(v) for v in range(16)]
                )
            )
        )
    with pytest.raises(ValueError, match=r"Batch leaf \['t'\] has no batch dimension"):
        next(
            iter(strategy.experimental_distribute_dataset([{"x": np.zeros(8), "t": np.float32(0)}]))
        )


# -- Bad input that used to get JAX's or XLA's error from inside (issue 23).


def test_string_and_object_arrays_are_named_with_their_dtype(devices):
    strategy = dt.MirroredStrategy()
    names = np.array(["a"] * 8)
    with pytest.raises(TypeError, match=r"Batch leaf \['name'\] has dtype <U1"):
        strategy.distribute_batch({"x": np.zeros(8), "name": names})
    with pytest.raises(TypeError, match=r"Batch leaf \['o'\] has dtype object"):
        next(
            iter(
                strategy.experimental_distribute_dataset(
                    [{"x": np.zeros(8), "o": np.array([None] * 8, dtype=object)}]
                )
            )
        )
    with pytest.raises(
        TypeError,
        match=r"run\(.*args\[1\]\['name'\] is a NumPy array of "
        r"dtype <U1.*numeric and bool",
    ):
        strategy.run(lambda x, meta: x, args=(np.zeros(3), {"name": names}))
    with pytest.raises(TypeError, match=r"kwargs\['meta'\] is a NumPy array of dtype object"):
        strategy.run(
            lambda x, meta: x,
            args=(np.zeros(3),),
            kwargs={"meta": np.array([None, 1], dtype=object)},
        )
    # A plain Python string stays a compile-time constant, as before.
    assert (
        float(
            strategy.reduce("mean", strategy.run(lambda x, tag: x.sum(), args=(np.ones(3), "tag")))
        )
        == 3.0
    )


def test_values_from_function_of_different_shapes_name_the_replicas(devices):
    strategy = dt.MirroredStrategy()
    with pytest.raises(
        ValueError,
        match=r"\['b'\] has shape \(2, 2\) on replicas "
        r"\[0, 1, 2, 3, 4, 6, 7\]; \(2, 3\) on replicas \[5\]",
    ):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: {
                "a": np.zeros(2),
                "b": np.ones((2, 3 if ctx.replica_id_in_sync_group == 5 else 2)),
            }
        )
    with pytest.raises(ValueError, match=r"same structure. Replica 0: .*replica 1: "):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: (1.0,) * (ctx.replica_id_in_sync_group + 1)
        )
    with pytest.raises(TypeError, match=r"the value has dtype <U1"):
        strategy.experimental_distribute_values_from_function(lambda ctx: np.array(["a"]))
    # Same shapes keep working: one component per replica.
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, ctx.replica_id_in_sync_group, np.float32)
    )
    assert _local(strategy, v)[3] == [3.0, 3.0]
