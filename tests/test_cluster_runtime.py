"""initialize_distributed and MultiWorkerMirroredStrategy inside this (single) test process.

The multi-process behaviour is in test_multi_worker*.py; here: idempotence, the
single-process path, and the errors that need no peers.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrain as dt
from distrain import (
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    initialize_distributed,
)
from distrain._src.cluster import runtime


@pytest.fixture(autouse=True)
def fresh_runtime(monkeypatch, devices):
    # Each test starts as if no cluster had been joined; the backend is up (8 devices).
    monkeypatch.setattr(runtime, "_joined", None)
    for name in (
        "DISTRAIN_COORDINATOR_ADDRESS",
        "DISTRAIN_NUM_PROCESSES",
        "DISTRAIN_PROCESS_ID",
        "TF_CONFIG",
        "DISTRAIN_TIMEOUT_SECONDS",
        "DISTRAIN_COLLECTIVES",
    ):
        monkeypatch.delenv(name, raising=False)
    return devices


def test_single_process_is_idempotent():
    r = SimpleClusterResolver(None, 1, 0, local_device_count=8)
    assert initialize_distributed(r) is r
    assert initialize_distributed(r) is r  # second call: no-op
    assert runtime._joined == (None, 1, 0)


def test_joining_a_second_cluster_is_an_error():
    initialize_distributed(SimpleClusterResolver(None, 1, 0))
    with pytest.raises(
        RuntimeError,
        match=r"already joined a cluster .*\(None, 1, 0\).*"
        r"cannot join \('127.0.0.1:1', 2, 1\)",
    ):
        initialize_distributed(SimpleClusterResolver("127.0.0.1:1", 2, 1))


def test_local_device_count_mismatch():
    with pytest.raises(RuntimeError, match=r"expected 3 local devices .* but has 8"):
        initialize_distributed(SimpleClusterResolver(None, 1, 0, local_device_count=3))


def test_joining_after_jax_started_is_an_error():
    with pytest.raises(RuntimeError, match=r"JAX has already created its devices"):
        initialize_distributed(
            SimpleClusterResolver("127.0.0.1:1", 2, 1), CommunicationOptions(timeout_seconds=1)
        )


@pytest.mark.parametrize("task_type", ["ps", "evaluator"])
def test_ps_and_evaluator_tasks_cannot_join(task_type):
    config = {
        "cluster": {"worker": ["a:1"], task_type: ["b:2"]},
        "task": {"type": task_type, "index": 0},
    }
    with pytest.raises(ValueError, match=rf"Task {task_type}:0 is not part of the synchronous"):
        MultiWorkerMirroredStrategy(TFConfigClusterResolver(json.dumps(config)))


def test_nccl_on_cpu_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"'nccl'\) needs GPU devices; this process's devices "
        r"are 'cpu'",
    ):
        MultiWorkerMirroredStrategy(communication_options=CommunicationOptions("nccl"))


def test_options_come_from_the_environment_by_default(monkeypatch):
    monkeypatch.setenv("DISTRAIN_COLLECTIVES", "nccl")
    with pytest.raises(ValueError, match=r"'nccl'\) needs GPU devices"):
        MultiWorkerMirroredStrategy()
    monkeypatch.setenv("DISTRAIN_COLLECTIVES", "ring")
    monkeypatch.setenv("DISTRAIN_TIMEOUT_SECONDS", "12")
    options = MultiWorkerMirroredStrategy().communication_options
    assert (options.implementation, options.heartbeat_timeout) == ("ring", 12)


def test_wrong_argument_types():
    with pytest.raises(
        TypeError,
        match=r"communication_options must be a "
        r"dt.CommunicationOptions. Received: str",
    ):
        MultiWorkerMirroredStrategy(communication_options="ring")
    with pytest.raises(TypeError, match=r"cluster_resolver must be a dt.ClusterResolver.*dict"):
        MultiWorkerMirroredStrategy(cluster_resolver={"worker": []})


def test_one_process_strategy_matches_mirrored(devices):
    strategy = MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == len(devices) == 8
    assert strategy.is_chief and strategy.cluster_resolver.num_processes == 1
    assert (strategy.num_processes, strategy.process_id) == (1, 0)

    def step(state, batch):
        def loss_fn(p):
            per_example = (batch["x"] @ p["w"] - batch["y"]) ** 2
            return dt.compute_average_loss(per_example, global_batch_size=16)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(16, 3)).astype(np.float32),
        "y": rng.normal(size=(16,)).astype(np.float32),
    }
    params = {"w": jnp.ones(3)}
    results = []
    for s in (strategy, dt.MirroredStrategy()):
        with s.scope():
            state = s.put_replicated(dt.TrainState.create(params=params, tx=optax.sgd(0.1)))
            state, loss = s.run(step, args=(state, s.distribute_batch(batch)))
            results.append((np.asarray(state.params["w"]), float(s.reduce("sum", loss))))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6)


def test_fail_fast_switch(monkeypatch):
    for value, enabled in (("", True), ("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv("DISTRAIN_FAIL_FAST", value)
        assert runtime._fail_fast_enabled() is enabled
    monkeypatch.setenv("DISTRAIN_FAIL_FAST", "sometimes")
    with pytest.raises(ValueError, match=r"FAIL_FAST must be 1 or 0\. Received: 'sometimes'"):
        runtime._fail_fast_enabled()
