"""ParameterServerStrategy on Ray: servers and workers are Ray actors.

Ray is started once for the module (2 CPUs, no dashboard, bound to
127.0.0.1) and shut down by the fixture's finalizer. Worker actors are real
processes: one is killed with ``ray.kill``, one crashes (``os._exit``) in the
middle of pushing its gradient, and a parameter-server actor is killed.
"""

import ipaddress
import sys

import jax
import numpy as np
import psutil
import pytest
import ray
import test_ps as common
from ray import cloudpickle

from distrain._src.ps.ray_backend import connect
from distrain.experimental import ParameterServerStrategy
from distrain.experimental.coordinator import ClusterCoordinator, ParameterServerUnavailableError
from distrain.experimental.partitioners import FixedShardsPartitioner

pytestmark = [pytest.mark.timeout(240), pytest.mark.one_end("newest")]  # one_end: tests/conftest.py


@pytest.fixture(scope="module")
def local_ray():
    # The test modules are not importable in Ray's worker processes: ship their
    # functions by value.
    for module in (sys.modules[__name__], common):
        cloudpickle.register_pickle_by_value(module)
    assert connect(None), "Ray was already running; this module starts its own"
    try:
        yield
    finally:
        ray.shutdown()
        for module in (sys.modules[__name__], common):
            cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture
def make(local_ray):
    made = []

    def build(**kwargs):
        strategy = ParameterServerStrategy(backend="ray", **kwargs)
        made.append(strategy)
        return strategy

    yield build
    for strategy in made:
        strategy.shutdown()


def test_local_ray_listens_on_loopback_only(local_ray):
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    # Every socket that Ray's processes (all started from this one) listen on.
    listening = []
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            conns, name = proc.net_connections(kind="inet"), proc.name()
        except psutil.NoSuchProcess:
            continue
        listening += [(name, c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN]
    assert {"gcs_server", "raylet"} <= {name for name, _ in listening}, listening
    for name, ip in listening:
        address = ipaddress.ip_address(ip)
        address = getattr(address, "ipv4_mapped", None) or address  # ::ffff:127.0.0.1
        assert address.is_loopback, (name, ip, listening)


def test_async_training_on_ray_converges_through_worker_crashes(make, digits):
    strategy, variables, step, coordinator = common.build(
        make, num_workers=3, num_ps=2, variable_partitioner=FixedShardsPartitioner(2)
    )
    assert strategy.num_workers == 3
    coordinator._inject_worker_failure(1, "push")  # the process exits mid-push
    iterator = iter(
        coordinator.create_per_worker_dataset(common.per_worker_epochs(digits[0], common.B))
    )
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(600)]
    values[100].fetch(timeout=120)
    ray.kill(coordinator._workers[0].actor)  # while steps are running
    coordinator.join()
    assert all(np.isfinite(v.fetch()["loss"]) for v in values)
    # As in test_ps: the machine's load decides the staleness, and so the accuracy reached.
    assert common.accuracy(variables.read(), digits[1]) >= 0.90
    assert coordinator.stats()["retried"] >= 2
    assert coordinator.stats()["workers_alive"] == 1
    stats = strategy.stats()
    assert [s["applied"] for s in stats] == [600, 600]  # none lost, none twice
    assert stats[0]["duplicates"] >= 1  # server 0 had the crashed push


def test_killed_parameter_server_is_reported_then_restored_on_ray(make, digits, tmp_path):
    strategy, variables, step, coordinator = common.build(make, num_workers=1)
    batches = common.fixed_batches(digits[0], 4, common.B)
    for b in batches[:3]:
        coordinator.schedule(step, args=(b,))
    assert coordinator.save(str(tmp_path)) == 3
    saved = variables.read()

    strategy._inject_ps_failure(0)  # ray.kill of the server actor
    coordinator.schedule(step, args=(batches[3],))
    with pytest.raises(ParameterServerUnavailableError, match="parameter server 0 is unavailable"):
        coordinator.join()

    # A new coordinator on new server actors resumes from the checkpoint
    # (training on restored servers is covered in-process, test_ps.py).
    strategy2, variables2, _, coordinator2 = common.build(make, num_workers=1)
    assert coordinator2.restore(str(tmp_path)) == 3
    jax.tree.map(np.testing.assert_array_equal, variables2.read(), saved)
    assert strategy2.stats()[0]["version"] == 3


def test_scheduling_on_ray_rejects_plain_functions(make):
    strategy = make(num_workers=1)
    with pytest.raises(TypeError, match="expects a step built by strategy.worker_step"):
        ClusterCoordinator(strategy).schedule(common.step_fn)


digits = common.digits
