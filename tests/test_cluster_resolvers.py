"""Cluster resolvers, CommunicationOptions and the coordinator probes (no JAX cluster needed)."""

import json
import re
import socket

import psutil
import pytest

from distrain import (
    AutoClusterResolver,
    CommunicationImplementation,
    CommunicationOptions,
    EnvClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    resolve_cluster,
)
from distrain._src.cluster.base import parse_address
from distrain._src.cluster.launch import free_port
from distrain._src.cluster.runtime import (
    check_port_free,
    coordinator_bind_address,
    wait_for_coordinator,
)


def tf_config(cluster, task_type, index):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


CLUSTER = {
    "chief": ["c0:2222"],
    "worker": ["w0:2222", "w1:2222"],
    "ps": ["p0:2222"],
    "evaluator": ["e0:2222"],
}


# ------------------------------------------------------------------ TF_CONFIG
@pytest.mark.parametrize(
    "task_type, index, process_id, chief",
    [("chief", 0, 0, True), ("worker", 0, 1, False), ("worker", 1, 2, False)],
)
def test_tf_config_with_chief_orders_chief_then_workers(task_type, index, process_id, chief):
    r = TFConfigClusterResolver(tf_config(CLUSTER, task_type, index))
    assert r.coordinator_address == "c0:2222"
    assert r.num_processes == 3  # ps and evaluator are not part of the mesh
    assert r.process_id == process_id
    assert (r.task_type, r.task_id, r.is_chief) == (task_type, index, chief)
    assert r.cluster_spec() == CLUSTER


def test_tf_config_without_chief_makes_worker_0_the_chief():
    cluster = {"worker": ["h0:1", "h1:2", "h2:3"], "ps": ["p:4"]}
    rs = [TFConfigClusterResolver(tf_config(cluster, "worker", i)) for i in range(3)]
    assert [r.process_id for r in rs] == [0, 1, 2]
    assert [r.is_chief for r in rs] == [True, False, False]
    assert {r.coordinator_address for r in rs} == {"h0:1"}


@pytest.mark.parametrize("task_type", ["ps", "evaluator"])
def test_tf_config_ps_and_evaluator_are_outside_the_mesh(task_type):
    r = TFConfigClusterResolver(tf_config(CLUSTER, task_type, 0))
    assert r.process_id is None and not r.is_chief
    assert r.task_type == task_type and r.num_processes == 3


def test_tf_config_read_from_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["a:1", "b:2"]}, "worker", 1))
    r = TFConfigClusterResolver()
    assert (r.process_id, r.num_processes) == (1, 2)
    assert isinstance(resolve_cluster(), TFConfigClusterResolver)


# TensorFlow's resolver interface, ported from TF's
# tensorflow/python/distribute/cluster_resolver/tfconfig_cluster_resolver_test.py
# (TFConfigClusterResolverTest, test names cited) and cluster_resolver.py.
TF_TEST_CLUSTER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}


def _tf_test_config(**extra):
    return json.dumps({"cluster": TF_TEST_CLUSTER, "task": {"type": "ps", "index": 0}, **extra})


def test_tf_normal_cluster_spec_read(monkeypatch):  # testNormalClusterSpecRead
    monkeypatch.setenv("TF_CONFIG", _tf_test_config())
    spec = TFConfigClusterResolver().cluster_spec()
    assert spec.as_dict() == TF_TEST_CLUSTER == spec
    assert spec.jobs == ["ps", "worker"]
    assert (spec.num_tasks("ps"), spec.num_tasks("worker")) == (2, 3)
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.job_tasks("worker") == TF_TEST_CLUSTER["worker"]
    assert spec.task_address("worker", 2) == "worker2:2222"
    with pytest.raises(ValueError, match=r"No such job in cluster: 'chief'.*\['ps', 'worker'\]"):
        spec.num_tasks("chief")
    with pytest.raises(ValueError, match=r"No task with index 3 in job 'worker'.*0\.\.2"):
        spec.task_address("worker", 3)


def test_tf_master_reads():
    # testAutomaticMasterRead, testSpecifiedTaskTypeAndIndexMasterRead
    r = TFConfigClusterResolver(_tf_test_config())
    assert r.master() == "ps0:2222"
    assert r.master("worker", 1) == "worker1:2222"
    assert r.master("worker", 1, rpc_layer="grpc") == "grpc://worker1:2222"
    # testSessionMasterRead
    r = TFConfigClusterResolver(_tf_test_config(session_master="sessionmaster:2222"))
    assert r.master() == "sessionmaster:2222"
    # testRpcLayerRead, testTaskTypeIndexRpcRead
    r = TFConfigClusterResolver(_tf_test_config(rpc_layer="grpc"))
    assert r.master() == "grpc://ps0:2222"
    assert (r.task_type, r.task_id, r.rpc_layer) == ("ps", 0, "grpc")
    # testOneItemInClusterSpecMasterRead
    one = {"cluster": {"worker": ["worker0:2222"]}, "task": {"type": "worker", "index": 0}}
    assert TFConfigClusterResolver(one).master() == ""


def test_tf_parameter_overrides():  # testParameterOverrides (TF's constructor overrides)
    config = json.dumps(
        {"cluster": TF_TEST_CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 1}}
    )
    r = TFConfigClusterResolver(config, task_type="ps", task_id=0)
    assert (r.master(), r.task_type, r.task_id) == ("grpc://ps0:2222", "ps", 0)
    r = TFConfigClusterResolver(config, task_type="worker", task_id=1, rpc_layer="test")
    assert (r.master(), r.task_type, r.task_id) == ("test://worker1:2222", "worker", 1)
    assert (r.rpc_layer, r.process_id, r.environment) == ("test", 1, None)
    assert TFConfigClusterResolver(config, environment="google").environment == "google"
    with pytest.raises(ValueError, match=r"index'\] is out of range.*0\.\.2.*Received: 5"):
        TFConfigClusterResolver(config, task_type="worker", task_id=5)


def test_tf_task_index_cast_to_integer():  # testTaskIndexCastToInteger
    config = json.dumps({"cluster": TF_TEST_CLUSTER, "task": {"type": "ps", "index": "1"}})
    assert TFConfigClusterResolver(config).task_id == 1


def test_resolvers_have_tf_defaults_and_count_accelerators(devices):
    # cluster_resolver.py: rpc_layer None, environment "" unless given; num_accelerators
    # counts this task's accelerators by kind, not CPUs.
    single = SimpleClusterResolver(None, 1, 0)
    assert (single.rpc_layer, single.environment) == (None, "")
    assert single.num_accelerators() == {}  # 8 CPU devices here: no accelerator
    assert single.num_accelerators("worker", 0) == {}
    with pytest.raises(
        ValueError,
        match=r"own devices only.*task_type='worker', task_id=0.*"
        r"task_type='worker', task_id=1",
    ):
        single.num_accelerators("worker", 1)
    two = SimpleClusterResolver("127.0.0.1:1234", 2, 1)
    with pytest.raises(RuntimeError, match=r"job of 2 processes.*after the cluster is joined"):
        two.num_accelerators()


def test_tf_config_accepts_a_dict_and_local_device_count():
    r = TFConfigClusterResolver(
        {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}},
        local_device_count=4,
    )
    assert r.local_device_count == 4 and r.local_device_ids is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", r"TF_CONFIG must be a JSON object.*Received: '\{not json'"),
        ("[1, 2]", r"TF_CONFIG must be a JSON object. Received: '\[1, 2\]'"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), r"missing the 'cluster' key"),
        (json.dumps({"cluster": {"worker": ["a:1"]}}), r"missing the 'task' key"),
        (
            tf_config({"worker": ["a:1", "b:2"]}, "worker", 2),
            r"TF_CONFIG\['task'\]\['index'\] is out of range.*2 'worker' task\(s\).*0\.\.1"
            r".*Received: 2",
        ),
        (tf_config({"worker": ["a:1"]}, "worker", -1), r"out of range.*Received: -1"),
        (
            tf_config({"chief": ["a:1", "b:2"], "worker": ["c:3"]}, "chief", 0),
            r"at most one chief. Received 2: \['a:1', 'b:2'\]",
        ),
        (
            tf_config({"worker": ["a:1"]}, "master", 0),
            r"TF_CONFIG\['task'\]\['type'\] must be one of chief, worker, ps, evaluator. "
            r"Received: 'master'",
        ),
        (
            tf_config({"worker": ["a:1"], "master": ["m:1"]}, "worker", 0),
            r"unknown task type 'master'",
        ),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}),
            r"TF_CONFIG\['task'\] is missing the 'type' key",
        ),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}),
            r"TF_CONFIG\['task'\] is missing the 'index' key",
        ),
        (tf_config({"worker": ["a:1"]}, "worker", "zero"), r"index'\] must be an integer.*'zero'"),
        (
            json.dumps(
                {
                    "cluster": {"worker": ["a:1"]},
                    "task": {"type": "worker", "index": 0},
                    "rpc_layer": 7,
                }
            ),
            r"rpc_layer must be a string.*Received: 7",
        ),
        (
            tf_config({"worker": ["nohost"]}, "worker", 0),
            r"TF_CONFIG\['cluster'\]\['worker'\]\[0\] must be a 'host:port'.*'nohost'",
        ),
        (
            tf_config({"worker": ["a:99999"]}, "worker", 0),
            r"port in 1..65535. Received: 'a:99999'",
        ),
        (tf_config({"worker": "a:1"}, "worker", 0), r"must be a list of 'host:port'"),
        (tf_config({"ps": ["p:1"]}, "ps", 0), r"at least one 'chief' or 'worker' task"),
        (json.dumps({"cluster": [], "task": {}}), r"TF_CONFIG\['cluster'\] must be an object"),
        (json.dumps({"cluster": {"worker": ["a:1"]}, "task": 3}), r"TF_CONFIG\['task'\] must be"),
    ],
)
def test_tf_config_errors_name_field_and_value(text, match):
    with pytest.raises(ValueError, match=match):
        TFConfigClusterResolver(text)


def test_tf_config_unset_is_an_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"TF_CONFIG is not set"):
        TFConfigClusterResolver()


def test_tf_config_bad_local_device_count():
    with pytest.raises(ValueError, match=r"local_device_count must be an integer >= 1.*0"):
        TFConfigClusterResolver(tf_config({"worker": ["a:1"]}, "worker", 0), local_device_count=0)


# ------------------------------------------------------------- env variables
def env(**kw):
    return {f"DISTRAIN_{k.upper()}": str(v) for k, v in kw.items()}


def test_env_resolver_reads_all_variables():
    r = EnvClusterResolver(
        env(
            coordinator_address="10.0.0.1:8476",
            num_processes=4,
            process_id=3,
            local_devices=2,
            local_device_ids="0,1",
        )
    )
    assert (r.coordinator_address, r.num_processes, r.process_id) == ("10.0.0.1:8476", 4, 3)
    assert (r.task_type, r.task_id, r.is_chief) == ("worker", 3, False)
    assert (r.local_device_count, r.local_device_ids) == (2, (0, 1))


def test_env_resolver_single_process_needs_no_address():
    r = EnvClusterResolver(env(num_processes=1))
    assert (r.coordinator_address, r.num_processes, r.process_id, r.is_chief) == (None, 1, 0, True)


@pytest.mark.parametrize(
    "variables, match",
    [
        (
            env(num_processes="two"),
            r"DISTRAIN_NUM_PROCESSES must be an integer >= 1. "
            r"Received: 'two'",
        ),
        (env(num_processes=0), r"DISTRAIN_NUM_PROCESSES must be an integer >= 1. Received: '0'"),
        (
            env(coordinator_address="a:1", num_processes=2, process_id=2),
            r"DISTRAIN_PROCESS_ID must be in 0..1 \(DISTRAIN_NUM_PROCESSES=2\). Received: "
            r"DISTRAIN_PROCESS_ID=2",
        ),
        (
            env(coordinator_address="a:1", num_processes=2, process_id=-1),
            r"DISTRAIN_PROCESS_ID must be an integer >= 0. Received: '-1'",
        ),
        (
            env(coordinator_address="a:1", num_processes=2),
            r"DISTRAIN_PROCESS_ID must be set \(0..1\)",
        ),
        (
            env(num_processes=2, process_id=0),
            r"DISTRAIN_COORDINATOR_ADDRESS must be set to process 0's 'host:port'",
        ),
        (
            env(coordinator_address="a:1", process_id=0),
            r"DISTRAIN_NUM_PROCESSES must be set when",
        ),
        (
            env(coordinator_address="nowhere", num_processes=2, process_id=0),
            r"DISTRAIN_COORDINATOR_ADDRESS must be a 'host:port'.*'nowhere'",
        ),
        (
            env(coordinator_address="a:1", num_processes=2, process_id=0, local_devices=0),
            r"DISTRAIN_LOCAL_DEVICES must be an integer >= 1",
        ),
        (
            env(coordinator_address="a:1", num_processes=2, process_id=0, local_device_ids="0,x"),
            r"DISTRAIN_LOCAL_DEVICE_IDS must be comma-separated integers.*'0,x'",
        ),
    ],
)
def test_env_resolver_errors(variables, match):
    with pytest.raises(ValueError, match=match):
        EnvClusterResolver(variables)


def test_resolve_cluster_prefers_env_over_tf_config_over_auto():
    tf = tf_config({"worker": ["a:1", "b:2"]}, "worker", 1)
    both = {**env(coordinator_address="x:1", num_processes=2, process_id=0), "TF_CONFIG": tf}
    assert isinstance(resolve_cluster(both), EnvClusterResolver)
    assert isinstance(resolve_cluster({"TF_CONFIG": tf}), TFConfigClusterResolver)
    assert isinstance(resolve_cluster({}), AutoClusterResolver)


def test_auto_resolver_without_scheduler_is_one_process(monkeypatch):
    for name in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    r = AutoClusterResolver()
    assert (r.num_processes, r.process_id, r.is_chief, r.coordinator_address) == (1, 0, True, None)
    assert r.environment is None


def test_auto_resolver_detects_slurm(monkeypatch):
    slurm = {
        "SLURM_JOB_ID": "123",
        "SLURM_STEP_NODELIST": "node[001-004]",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
    }
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    r = AutoClusterResolver()
    assert r.environment == "slurm"
    assert (r.num_processes, r.process_id, r.is_chief) == (4, 2, False)


# ----------------------------------------------------------- simple resolver
@pytest.mark.parametrize(
    "args, match",
    [
        ((None, 2, 0), r"coordinator address .* is required when num_processes > 1"),
        (("a:1", 2, 2), r"process_id must be in 0..num_processes-1 = 0..1. Received: process_id=2"),
        (("a:1", 0, 0), r"num_processes must be an integer >= 1. Received: 0"),
        (("a:1", 2, True), r"process_id must be an integer >= 0. Received: True"),
        (("a:1", 1, 0, None, []), r"local_device_ids must be a non-empty list"),
    ],
)
def test_simple_resolver_errors(args, match):
    with pytest.raises(ValueError, match=match):
        SimpleClusterResolver(*args)


def test_parse_address_accepts_ipv6():
    assert parse_address("[::1]:80", field="f") == ("::1", 80)
    assert parse_address("host.example:1", field="f") == ("host.example", 1)
    with pytest.raises(ValueError, match=r"f must be a 'host:port' string.*Received: 3"):
        parse_address(3, field="f")
    with pytest.raises(ValueError, match=r"port in 1..65535. Received: ':80'"):
        parse_address(":80", field="f")


# ----------------------------------------------------- communication options
def test_communication_options_defaults_and_mapping():
    o = CommunicationOptions()
    assert o.implementation is CommunicationImplementation.AUTO
    assert (o.initialization_timeout, o.heartbeat_timeout, o.shutdown_timeout) == (300, 20, 300)
    assert o.cpu_collectives == "gloo"
    o = CommunicationOptions("RING", timeout_seconds=2.5, shutdown_timeout_seconds=7)
    assert o.implementation is CommunicationImplementation.RING
    assert (o.initialization_timeout, o.heartbeat_timeout, o.shutdown_timeout) == (3, 3, 7)
    o = CommunicationOptions(CommunicationImplementation.NCCL, heartbeat_timeout_seconds=9)
    assert o.cpu_collectives is None and o.heartbeat_timeout == 9


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"implementation": "mpi"},
            r"implementation must be one of 'auto', 'ring', 'nccl'. "
            r"Received: 'mpi'",
        ),
        ({"implementation": 3}, r"implementation must be one of .*Received: 3"),
        ({"timeout_seconds": 0}, r"timeout_seconds must be a positive number.*Received: 0"),
        ({"heartbeat_timeout_seconds": -1}, r"heartbeat_timeout_seconds must be a positive"),
        ({"timeout_seconds": "10"}, r"timeout_seconds must be a positive number.*'10'"),
    ],
)
def test_communication_options_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CommunicationOptions(**kwargs)


def test_communication_options_platform_checks():
    CommunicationOptions("auto").check_platform("cpu")
    CommunicationOptions("nccl").check_platform("gpu")
    with pytest.raises(ValueError, match=r"implementation='nccl'\) needs GPU devices.*'cpu'"):
        CommunicationOptions("nccl").check_platform("cpu")
    with pytest.raises(ValueError, match=r"implementation='ring'\) is host \(gloo\)"):
        CommunicationOptions("ring").check_platform("gpu")


def test_communication_options_from_env():
    o = CommunicationOptions.from_env(
        {"DISTRAIN_TIMEOUT_SECONDS": "4", "DISTRAIN_COLLECTIVES": "ring"}
    )
    assert (o.implementation, o.heartbeat_timeout) == (CommunicationImplementation.RING, 4)
    assert CommunicationOptions.from_env({}).timeout_seconds is None
    with pytest.raises(ValueError, match=r"DISTRAIN_TIMEOUT_SECONDS must be a positive.*'soon'"):
        CommunicationOptions.from_env({"DISTRAIN_TIMEOUT_SECONDS": "soon"})
    with pytest.raises(ValueError, match=r"DISTRAIN_TIMEOUT_SECONDS must be a positive.*'-2'"):
        CommunicationOptions.from_env({"DISTRAIN_TIMEOUT_SECONDS": "-2"})


# ------------------------------------------------------- coordinator probes
def test_wait_for_coordinator_times_out_naming_the_address():
    port = free_port()  # free a moment ago: nothing listens there
    with pytest.raises(TimeoutError, match=rf"coordinator at 127.0.0.1:{port} within 0.5 s"):
        wait_for_coordinator(f"127.0.0.1:{port}", timeout=0.5)


def test_wait_for_coordinator_returns_once_listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert wait_for_coordinator(f"127.0.0.1:{s.getsockname()[1]}", timeout=5) < 5


def test_check_port_free_rejects_a_port_in_use():
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
        s.bind(("::" if socket.has_ipv6 else "0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=rf"port {port} .* is already in use"):
            check_port_free(f"127.0.0.1:{port}")
    check_port_free(f"127.0.0.1:{port}")  # released: fine now


@pytest.mark.parametrize(
    "address, environ, expected",
    [
        ("127.0.0.1:8476", {}, "127.0.0.1:8476"),  # distrain launch: loopback only
        ("127.0.0.2:8476", {}, "127.0.0.2:8476"),
        ("[::1]:8476", {}, "[::1]:8476"),
        ("localhost:8476", {}, "localhost:8476"),
        ("10.0.0.1:8476", {}, "[::]:8476"),  # other machines connect: JAX's default
        ("host0:8476", {}, "[::]:8476"),  # may resolve to 127.0.1.1 here: not narrowed
        # JAX's own variable wins, even with another port (a forwarded one).
        ("127.0.0.1:8476", {"JAX_COORDINATOR_BIND_ADDRESS": "0.0.0.0:9000"}, "0.0.0.0:9000"),
        ("10.0.0.1:8476", {"JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.1:8476"}, "10.0.0.1:8476"),
    ],
)
def test_coordinator_bind_address(address, environ, expected):
    assert coordinator_bind_address(address, environ) == expected


def test_coordinator_bind_address_rejects_a_malformed_variable():
    with pytest.raises(ValueError, match=r"JAX_COORDINATOR_BIND_ADDRESS must be a 'host:port'"):
        coordinator_bind_address("10.0.0.1:8476", {"JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.1"})


def test_check_port_free_on_a_loopback_bind_address():
    with socket.socket() as s:  # a live listener on 127.0.0.1 only
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=rf"port {port} .* is already in use"):
            check_port_free(f"127.0.0.1:{port}", f"127.0.0.1:{port}")
    check_port_free(f"127.0.0.1:{port}", f"127.0.0.1:{port}")  # released: fine now


def test_check_port_free_names_a_bind_address_this_machine_cannot_use():
    port = free_port()
    # An address reserved for documentation (RFC 5737) that no interface here has.
    mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    foreign = next(ip for ip in ("192.0.2.1", "198.51.100.1", "203.0.113.1") if ip not in mine)
    match = rf"coordinator on {re.escape(foreign)}:\d+, but cannot listen"
    with pytest.raises(OSError, match=match):
        check_port_free(f"10.0.0.1:{port}", f"{foreign}:{port}")
    with pytest.raises(OSError, match=r"'no-such-host\.invalid' does not resolve"):
        check_port_free(f"10.0.0.1:{port}", f"no-such-host.invalid:{port}")
