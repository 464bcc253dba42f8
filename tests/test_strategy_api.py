"""The tf.distribute surface: run, reduce, gather, contexts, caching and bad input."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrain as dt


@pytest.fixture
def mirrored(devices):
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    return strategy


def _ones(_):
    return jnp.ones(())


def test_reduce_sum_of_ones_is_num_replicas(mirrored):
    out = mirrored.run(
        lambda: jnp.ones(()) * (dt.get_replica_context().replica_id_in_sync_group * 0 + 1)
    )
    assert isinstance(out, dt.PerReplica)
    assert float(mirrored.reduce(dt.ReduceOp.SUM, out)) == 8.0


def test_reduce_mean_over_axis(devices):
    strategy = dt.MirroredStrategy(["cpu:0", "cpu:1"])
    per_replica = strategy.run(
        lambda: jnp.array([1.0, 2.0]) + 0 * dt.get_replica_context().replica_id_in_sync_group
    )
    assert float(strategy.reduce("mean", per_replica, axis=0)) == 1.5
    np.testing.assert_array_equal(strategy.reduce("sum", per_replica), [2.0, 4.0])


def test_gather_concatenates_in_replica_order(mirrored):
    ids = mirrored.run(lambda: dt.get_replica_context().replica_id_in_sync_group[None] * 10)
    np.testing.assert_array_equal(mirrored.gather(ids, axis=0), np.arange(8) * 10)
    local = mirrored.experimental_local_results(ids)
    assert [int(x[0]) for x in local] == list(range(0, 80, 10))


def test_replica_context_collectives(mirrored):
    def fn():
        ctx = dt.get_replica_context()
        rid = ctx.replica_id_in_sync_group.astype(jnp.float32)
        return ctx.all_reduce("sum", rid), ctx.all_reduce("mean", rid), ctx.all_gather(rid[None])

    total, mean, gathered = mirrored.run(fn)
    # all-reduced results are identical on every replica: they come back replicated
    assert not isinstance(total, dt.PerReplica)
    assert float(total) == 28.0 and float(mean) == 3.5
    np.testing.assert_array_equal(gathered, np.arange(8))


def test_dataset_of_16_batched_by_8_gives_each_replica_one_element_in_order(mirrored):
    data = np.arange(16, dtype=np.float32)
    ds = mirrored.experimental_distribute_dataset([data[:8], data[8:]])
    seen = []
    for batch in ds:
        parts = mirrored.experimental_local_results(batch)
        assert all(p.shape == (1,) for p in parts)
        seen.append([float(p[0]) for p in parts])
    assert seen == [list(range(8)), list(range(8, 16))]


def test_broadcast_args_and_static_python_values(mirrored):
    def fn(x, scale, batch):
        return x * scale + batch.sum()

    batch = mirrored.distribute_batch(np.arange(8.0, dtype=np.float32))
    out = mirrored.run(fn, args=(jnp.float32(1.0), 2.0, batch))
    np.testing.assert_array_equal(mirrored.gather(out), 2.0 + np.arange(8.0))


def test_run_compiles_once_per_function_and_shape(mirrored):
    traces = []

    def fn(x):
        traces.append(1)
        return dt.get_replica_context().all_reduce("sum", x)

    x = mirrored.distribute_batch(np.ones((8, 3), np.float32))
    for _ in range(5):
        mirrored.run(fn, args=(x,))
    assert len(traces) == 1
    mirrored.run(fn, args=(mirrored.distribute_batch(np.ones((16, 3), np.float32)),))
    assert len(traces) == 2


def test_many_steps_in_flight_do_not_deadlock(mirrored):
    """An unbounded queue of collectives deadlocks on CPU after ~50 steps."""
    x = mirrored.put_replicated(jnp.zeros(()))
    batch = mirrored.distribute_batch(np.ones(8, np.float32))

    def step(x, b):
        return x + dt.get_replica_context().all_reduce("sum", b.sum())

    for _ in range(200):
        x = mirrored.run(step, args=(x, batch))
    assert float(x) == 1600.0


def test_contexts(mirrored):
    assert not dt.has_strategy()
    assert dt.get_replica_context() is not None  # the default replica context
    assert not dt.in_cross_replica_context()
    assert dt.get_strategy().num_replicas_in_sync == 1
    with mirrored.scope():
        assert dt.get_strategy() is mirrored and dt.has_strategy()
        assert dt.in_cross_replica_context()
        assert dt.get_replica_context() is None

        def fn():
            assert not dt.in_cross_replica_context()
            assert dt.get_strategy() is mirrored
            return dt.get_replica_context().num_replicas_in_sync * jnp.ones(())

        assert float(mirrored.run(fn)) == 8.0
    assert not dt.has_strategy()


def test_distribute_values_from_function(mirrored):
    values = mirrored.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group)
    )
    assert float(mirrored.reduce("sum", values)) == 28.0
    doubled = mirrored.run(lambda v: v * 2, args=(values,))
    np.testing.assert_array_equal(mirrored.gather(doubled), np.arange(8) * 2)


def test_distribute_datasets_from_function(mirrored):
    def dataset_fn(ctx):
        assert ctx.num_input_pipelines == 1 and ctx.input_pipeline_id == 0
        per_replica = ctx.get_per_replica_batch_size(16)
        assert per_replica == 2
        return [np.arange(16, dtype=np.float32)]

    batch = next(iter(mirrored.distribute_datasets_from_function(dataset_fn)))
    np.testing.assert_array_equal(mirrored.gather(batch), np.arange(16))


def test_default_strategy_runs_one_replica():
    strategy = dt.get_strategy()
    out = strategy.run(
        lambda x: dt.get_replica_context().all_reduce("sum", x), args=(jnp.arange(3.0),)
    )
    np.testing.assert_array_equal(out, [0.0, 1.0, 2.0])
    assert float(strategy.reduce("sum", jnp.float32(5.0))) == 5.0


# ---------------------------------------------------------------- bad input
def test_batch_not_divisible_by_replicas(mirrored):
    with pytest.raises(ValueError, match=r"global batch size \(12\).*number of replicas \(8\)"):
        mirrored.distribute_batch(np.ones((12, 2)))


def test_nonexistent_device():
    with pytest.raises(ValueError, match="No device matches 'cpu:99'.*Available devices"):
        dt.MirroredStrategy(["cpu:99"])
    with pytest.raises(ValueError, match="duplicates"):
        dt.MirroredStrategy(["cpu:0", 0])
    with pytest.raises(ValueError, match="at least one device"):
        dt.MirroredStrategy([])


def test_inconsistent_batch_shapes(mirrored):
    with pytest.raises(ValueError, match="same leading.*'x'.*\\(8, 2\\).*'y'.*\\(16,\\)"):
        mirrored.distribute_batch({"x": np.ones((8, 2)), "y": np.ones(16)})


def test_reduce_unknown_op_and_sum_of_non_distributed(mirrored):
    with pytest.raises(ValueError, match="Unknown reduce op.*'max'"):
        mirrored.reduce("max", jnp.ones(()))
    with pytest.raises(ValueError, match="Only results of `strategy.run` can be reduced with SUM"):
        mirrored.reduce("sum", jnp.ones(()))
    assert float(mirrored.reduce("mean", jnp.ones(()))) == 1.0


def test_nested_scopes_of_different_strategies(mirrored):
    other = dt.OneDeviceStrategy("cpu:1")
    with mirrored.scope():
        with mirrored.scope():  # re-entering the same strategy is fine
            pass
        with pytest.raises(RuntimeError, match="inside the scope of another strategy"):
            with other.scope():
                pass


@pytest.mark.parametrize("method", ["reduce", "gather", "run", "experimental_local_results"])
def test_cross_replica_methods_inside_run(mirrored, method):
    calls = {
        "reduce": lambda: mirrored.reduce("sum", jnp.ones(())),
        "gather": lambda: mirrored.gather(jnp.ones(1)),
        "run": lambda: mirrored.run(_ones, args=(1,)),
        "experimental_local_results": lambda: mirrored.experimental_local_results(jnp.ones(1)),
    }

    def fn():
        calls[method]()
        return jnp.ones(())

    with pytest.raises(RuntimeError, match=f"`MirroredStrategy.{method}` is a cross-replica"):
        mirrored.run(fn)


def test_unhashable_static_argument(mirrored):
    with pytest.raises(TypeError, match="must be hashable"):
        mirrored.run(lambda d: jnp.ones(()), args=(bytearray(b"x"),))


def test_per_replica_from_another_strategy(mirrored):
    batch = dt.MirroredStrategy(["cpu:0", "cpu:1"]).distribute_batch(np.ones(8))
    with pytest.raises(ValueError, match="made for 2 replicas.*strategy with 8"):
        mirrored.run(lambda b: b, args=(batch,))


def test_cross_device_ops_validation():
    with pytest.raises(ValueError, match="num_packs.*Received: num_packs=0"):
        dt.HierarchicalCopyAllReduce(num_packs=0)
    with pytest.raises(TypeError, match="must be a dt.CrossDeviceOps"):
        dt.MirroredStrategy(cross_device_ops="nccl")


def test_cross_device_ops_give_the_same_sum(devices):
    tree = {"a": np.arange(8 * 3, dtype=np.float32).reshape(8, 3), "b": np.ones((8,), np.int32)}
    results = []
    for ops in (dt.AllReduce(), dt.HierarchicalCopyAllReduce(3), dt.ReductionToOneDevice()):
        s = dt.MirroredStrategy(cross_device_ops=ops)
        out = s.run(
            lambda t: dt.get_replica_context().all_reduce("sum", t),
            args=(s.distribute_batch(tree),),
        )
        results.append(jax.tree.map(np.asarray, out))
    for r in results[1:]:
        jax.tree.map(np.testing.assert_array_equal, r, results[0])
    np.testing.assert_array_equal(results[0]["a"], tree["a"].sum(0, keepdims=True))


def test_donated_state_is_reused_and_steps_stay_bounded(mirrored):
    """With every output donated to the next call, the in-flight bound still holds."""
    batch = mirrored.distribute_batch(np.ones(8, np.float32))

    def step(x, b):
        return x + dt.get_replica_context().all_reduce("sum", b.sum())

    x0 = mirrored.put_replicated(jnp.zeros(()))
    x = mirrored.run(step, args=(x0, batch), donate_argnums=(0,))
    assert x0.is_deleted()
    for _ in range(200):
        x = mirrored.run(step, args=(x, batch), donate_argnums=(0,))
    assert float(x) == 1608.0


def test_bad_donate_argnums(mirrored):
    with pytest.raises(ValueError, match="indices of the 1 positional args.*\\(1,\\)"):
        mirrored.run(lambda x: x, args=(jnp.ones(()),), donate_argnums=(1,))


def test_int_and_float_constants_compile_separately(mirrored):
    out_int = mirrored.run(lambda c: jnp.asarray(c), args=(2,))
    out_float = mirrored.run(lambda c: jnp.asarray(c), args=(2.0,))
    assert out_int.dtype == jnp.int32 and out_float.dtype == jnp.float32


def test_a_partial_step_compiles_under_a_short_name(devices):
    """A partial's repr holds its arguments (here a config, in the examples a model's
    whole graph): as the program's name it was a file name too long for jax's
    persistent compilation cache, which then failed to write every entry."""

    def step(config, x):
        return x * 2

    fn = functools.partial(step, {"config": "x" * 5000})
    s = dt.MirroredStrategy()
    with pytest.raises(TypeError, match=r"strategy.run\(partial\(.*step\), args=...\)"):
        s.run(fn, args=5)
    batch = s.distribute_batch(np.ones((8, 2), np.float32))
    text = s._compiler.compile(fn, (batch,), {}).as_text()
    name = re.search(r"HloModule (\S+?),", text)[1]
    assert "partial" in name and "step" in name and len(name) < 100, name
