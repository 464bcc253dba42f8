"""The tf.distribute contract as a TensorFlow user relies on it.

Everything ``strategy.run`` returns reduces as in TensorFlow (a mirrored value sums to
``num_replicas x value``), the cross-replica methods take any pytree of distributed
values, and the mistakes a TF port makes (mutating captured state, wrong argument
shapes) get an error that says what to do instead of a silent wrong result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain._src.cluster.launch import free_port
from tests.processes import run_together
from tests.test_multi_worker import clean_env

N = 8


@pytest.fixture(scope="module")
def mirrored():
    strategy = dt.MirroredStrategy()
    assert strategy.num_replicas_in_sync == N
    return strategy


# ---------------------------------------------------------- reduce of run's results
def test_sum_of_a_constant_returned_by_run_counts_every_replica(mirrored):
    out = mirrored.run(lambda: jnp.float32(2.5))
    assert not isinstance(out, dt.PerReplica)  # one copy, not N
    assert out.sharding.is_fully_replicated
    assert float(mirrored.reduce("sum", out)) == N * 2.5
    assert float(mirrored.reduce("mean", out)) == 2.5
    vec = mirrored.run(lambda: jnp.arange(3.0))
    np.testing.assert_array_equal(mirrored.reduce("sum", vec), N * np.arange(3.0))
    assert float(mirrored.reduce("sum", vec, axis=0)) == N * 3.0


def test_scale_regularization_loss_sums_back_to_the_loss(mirrored):
    scaled = mirrored.run(lambda: dt.scale_regularization_loss(jnp.float32(4.0)))
    assert float(mirrored.reduce("sum", scaled)) == pytest.approx(4.0)


def test_a_metrics_object_returned_by_run_reduces_with_sum(mirrored):
    batch = mirrored.distribute_batch(np.arange(16, dtype=np.float32))
    metric = mirrored.run(dt.metrics.Mean.from_values, args=(batch,))
    total = mirrored.reduce("sum", metric)
    assert float(total.count) == 16.0  # the constant count of 2 per replica, 8 times
    assert total.compute() == pytest.approx(np.arange(16).mean())


def test_the_returned_state_is_one_copy_and_feeds_the_next_step(mirrored):
    state = mirrored.put_replicated({"w": jnp.zeros(3)})
    for _ in range(3):
        state = mirrored.run(lambda s: {"w": s["w"] + 1}, args=(state,))
    assert state["w"].sharding.is_fully_replicated
    np.testing.assert_array_equal(state["w"], [3.0, 3.0, 3.0])
    assert float(mirrored.reduce("sum", state["w"], axis=0)) == N * 9.0


def test_sum_of_an_array_that_run_did_not_return_is_still_an_error(mirrored):
    with pytest.raises(ValueError, match="Only results of `strategy.run`.*use MEAN"):
        mirrored.reduce("sum", jnp.ones(()))  # on one device: it has no replicas
    with pytest.raises(ValueError, match="Only results of `strategy.run`"):
        mirrored.reduce("sum", np.float32(1))


def test_central_storage_results_reduce_too():
    strategy = dt.experimental.CentralStorageStrategy()
    out = strategy.run(lambda: jnp.float32(1.0))
    assert float(strategy.reduce("sum", out)) == strategy.num_replicas_in_sync


def test_sum_of_a_constant_over_two_worker_processes(tmp_path):
    port = free_port()
    script = tmp_path / "sum_constant.py"
    script.write_text(
        "import json, jax.numpy as jnp\n"
        "import distrain as dt\n"
        "s = dt.MultiWorkerMirroredStrategy()\n"
        "one = s.run(lambda: jnp.float32(1.0))\n"
        "scaled = s.run(lambda: dt.scale_regularization_loss(jnp.float32(6.0)))\n"
        "print('OK', json.dumps([float(s.reduce('sum', one)), "
        "float(s.reduce('sum', scaled))]), flush=True)\n"
    )
    jobs = []
    for i in range(2):
        env = clean_env(
            2,
            DISTRAIN_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            DISTRAIN_NUM_PROCESSES="2",
            DISTRAIN_PROCESS_ID=str(i),
            DISTRAIN_TIMEOUT_SECONDS="20",
            PYTHONPATH=str(Path(__file__).parents[1]),
        )
        jobs.append(([sys.executable, str(script)], env))
    for code, log, _ in run_together(jobs, 90):
        assert code == 0, log
        assert json.loads(log.split("OK ", 1)[1].splitlines()[0]) == [4.0, pytest.approx(6.0)]


# ------------------------------------------------- cross-replica methods on pytrees
def test_gather_reduce_and_local_results_on_a_distributed_dict_batch(mirrored):
    data = {"x": np.arange(32, dtype=np.float32).reshape(16, 2), "y": np.arange(16.0)}
    batch = next(iter(mirrored.experimental_distribute_dataset([data])))
    gathered = mirrored.gather(batch, axis=0)
    np.testing.assert_array_equal(gathered["x"], data["x"])
    np.testing.assert_array_equal(gathered["y"], data["y"])
    np.testing.assert_array_equal(
        mirrored.reduce("sum", batch)["y"], data["y"].reshape(8, 2).sum(0)
    )
    assert float(mirrored.reduce("sum", batch, axis=0)["y"]) == data["y"].sum()
    assert float(mirrored.reduce("mean", batch, axis=0)["y"]) == data["y"].mean()
    local = mirrored.experimental_local_results(batch)
    assert len(local) == N
    np.testing.assert_array_equal(local[3]["x"], data["x"][6:8])


def test_axis_errors_name_the_axis_and_the_rank(mirrored):
    losses = mirrored.run(lambda x: jnp.sum(x), args=(mirrored.distribute_batch(np.ones(16)),))
    vectors = mirrored.run(lambda x: x * 2, args=(mirrored.distribute_batch(np.ones(16)),))
    with pytest.raises(ValueError, match="axis=0.*rank 0.*pass axis=None"):
        mirrored.reduce("sum", losses, axis=0)
    with pytest.raises(ValueError, match=r"axis=5.*rank 1 \(valid: -1..0\)"):
        mirrored.reduce("sum", vectors, axis=5)
    with pytest.raises(ValueError, match="axis=7.*rank 1"):
        mirrored.gather(vectors, axis=7)
    with pytest.raises(TypeError, match="takes an int or None.*axis='0'"):
        mirrored.reduce("sum", vectors, axis="0")
    # In range: negative axes count from the end, scalar components gather one row each.
    assert mirrored.reduce("sum", vectors, axis=-1).shape == ()
    assert mirrored.gather(losses).shape == (N,)


def test_a_per_replica_value_of_another_strategy_is_refused(mirrored):
    four = dt.MirroredStrategy(["cpu:4", "cpu:5", "cpu:6", "cpu:7"])
    other = dt.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    batch = four.distribute_batch(np.ones(8))
    with pytest.raises(ValueError, match="placed on other devices than this strategy's"):
        other.run(lambda x: x, args=(batch,))
    with pytest.raises(ValueError, match="placed on other devices than this strategy's"):
        other.reduce("sum", batch)
    with pytest.raises(ValueError, match="made for 4 replicas.*8 replicas"):
        mirrored.run(lambda x: x, args=(batch,))


# ------------------------------------------------------- TF-style step mistakes
def _loss(params, x):
    return jnp.mean((x @ params["w"]) ** 2)


def _tf_state():
    p = {"w": jnp.ones((2, 1))}
    return dt.TrainState.create(params=p, tx=optax.sgd(0.1))


TF_STATE = _tf_state()


def _tf_style_step(x):
    """Mutates a global state, as a TF step mutates its variables."""
    global TF_STATE
    grads = jax.grad(_loss)(TF_STATE.params, x)
    TF_STATE = TF_STATE.apply_gradients(grads=grads)
    return _loss(TF_STATE.params, x)


def test_a_step_that_assigns_traced_state_to_a_global_is_refused(mirrored):
    global TF_STATE
    TF_STATE = _tf_state()
    batch = mirrored.distribute_batch(np.ones((16, 2), np.float32))
    with pytest.raises(RuntimeError, match=r"_tf_style_step.*traced values in \['TF_STATE'\]"):
        mirrored.run(_tf_style_step, args=(batch,))


def test_a_step_that_reads_placed_state_from_a_closure_is_refused(mirrored):
    state = mirrored.put_replicated(_tf_state())
    batch = mirrored.distribute_batch(np.ones((16, 2), np.float32))

    def step(x):
        return _loss(state.params, x)

    with pytest.raises(
        ValueError, match=r"step.*reads arrays placed on several devices from \['state'\]"
    ):
        mirrored.run(step, args=(batch,))


def test_a_step_that_changes_its_argument_in_place_is_refused(mirrored):
    params = mirrored.put_replicated({"w": jnp.ones((2, 1))})
    batch = mirrored.distribute_batch(np.ones((16, 2), np.float32))

    def step(params, x):
        params["w"] = params["w"] - 0.1 * jax.grad(_loss)(params, x)["w"]
        return _loss(params, x)

    with pytest.raises(RuntimeError, match="changed its arguments in place.*return the new"):
        mirrored.run(step, args=(params, batch))


def test_the_trainer_reports_a_tf_style_step_too(mirrored):
    global TF_STATE
    TF_STATE = _tf_state()

    def train_step(state, batch):
        return state, {"loss": _tf_style_step(batch["x"])}

    data = dt.data.ArrayPipeline({"x": np.ones((32, 2), np.float32)}, global_batch_size=16)
    with pytest.raises(RuntimeError, match=r"stored traced values in .*TF_STATE"):
        dt.Trainer(mirrored, train_step).fit(_tf_state(), data, steps=1)


# --------------------------------------------------------- run's argument errors
def test_run_argument_errors(mirrored):
    x = jnp.ones(3)
    with pytest.raises(TypeError, match="needs a function as `fn`. Received: 3"):
        mirrored.run(3)
    with pytest.raises(TypeError, match="tuple of positional arguments.*ArrayImpl.*args=\\(x,\\)"):
        mirrored.run(lambda a: a, args=x)
    with pytest.raises(TypeError, match="takes a tuple.*Received a dict"):
        mirrored.run(lambda a: a, args={"a": x})
    with pytest.raises(TypeError, match="kwargs=.*takes a mapping.*Received a list"):
        mirrored.run(lambda a: a, kwargs=[x])

    def named(a):
        return {"out": "not an array"}

    with pytest.raises(TypeError, match=r"`.*named` returned a str at `\['out'\]`"):
        mirrored.run(named, args=(x,))


def test_donate_argnums_takes_an_int_as_jax_jit_does(mirrored):
    state = mirrored.put_replicated(jnp.zeros(4))
    new = mirrored.run(lambda s: s + 1, args=(state,), donate_argnums=0)
    np.testing.assert_array_equal(new, np.ones(4))


def test_a_string_leaf_in_the_state_is_named(mirrored):
    with pytest.raises(TypeError, match=r"leaf at `\['name'\]` is a str"):
        mirrored.put_replicated({"w": np.ones(2), "name": "model-a"})


# ------------------------------------------------------------------- Trainer input
def test_fit_refuses_a_negative_initial_epoch(mirrored):
    from tests.linear_problem import new_state, problem, train_step

    data = dt.data.ArrayPipeline(problem(64), global_batch_size=32)
    with pytest.raises(ValueError, match="`initial_epoch` must be >= 0.*initial_epoch=-3"):
        dt.Trainer(mirrored, train_step).fit(new_state(), data, epochs=1, initial_epoch=-3)


def test_a_nan_loss_without_terminate_on_nan_warns_once(mirrored):
    from tests.linear_problem import new_state, problem, train_step

    arrays = problem(64)
    arrays["x"][0, 0] = np.nan
    data = dt.data.ArrayPipeline(arrays, global_batch_size=64, num_epochs=None)
    trainer = dt.Trainer(mirrored, train_step, log_every=1)
    with pytest.warns(RuntimeWarning, match="not finite at step 1.*TerminateOnNaN") as seen:
        trainer.fit(new_state(), data, steps=3)
    assert len([w for w in seen if "not finite" in str(w.message)]) == 1
    with pytest.raises(RuntimeError):  # with the callback: no warning, it stops
        trainer.fit(
            new_state(), data, steps=3, callbacks=[dt.callbacks.TerminateOnNaN(raise_error=True)]
        )


def test_apply_gradients_names_a_gradient_structure_mismatch(mirrored):
    state = dt.TrainState.create(params={"w": jnp.ones(2), "b": jnp.ones(())}, tx=optax.sgd(1))
    with pytest.raises(ValueError, match="(?s)structure of `params`.*grads:.*params:"):
        state.apply_gradients(grads={"w": jnp.ones(2)})


def test_the_trainer_says_what_to_use_with_parameter_servers():
    from tests.linear_problem import train_step

    strategy = dt.experimental.ParameterServerStrategy(num_workers=1)
    with pytest.raises(TypeError, match="ClusterCoordinator\\(strategy\\).*schedule"):
        dt.Trainer(strategy, train_step)
