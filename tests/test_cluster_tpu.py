"""TPUClusterResolver on the variables and metadata a TPU VM provides (no TPU runs here).

The environments are the ones GKE writes into the pods of a multi-host TPU slice
(TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_HOST_BOUNDS,
TPU_CHIPS_PER_HOST_BOUNDS, TPU_SKIP_MDS_QUERY) and the MEGASCALE_* variables xpk's JobSet
adds for multislice; they are set in this process's environment (monkeypatch.setenv)
and read from os.environ. A Cloud TPU VM's metadata (agent-worker-number,
worker-network-endpoints, accelerator-type, tpu-env) is served by a local HTTP server in
the role of the GCE metadata server, on a machine made a GCE VM by its DMI product name.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

import distrain as dt
from distrain._src.cluster import gce
from distrain._src.cluster.gce import Metadata, parse_tpu_env

TPU_VARIABLES = (
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "TPU_ACCELERATOR_TYPE",
    "TPU_TOPOLOGY",
    "TPU_HOST_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "TPU_TOPOLOGY_WRAP",
    "TPU_SKIP_MDS_QUERY",
    "TPU_NAME",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "MEGASCALE_PORT",
    "JAX_COORDINATOR_PORT",
    "GCE_METADATA_HOST",
    "GCE_METADATA_IP",
)


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    """No TPU variable from this machine (JAX sets TPU_SKIP_MDS_QUERY=1 at import on a
    machine without TPU chips), and a machine that is not a GCE VM unless a test says so."""
    for name in TPU_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    product = tmp_path / "product_name"
    product.write_text("Standard PC (Q35 + ICH9, 2009)\n")
    monkeypatch.setattr(gce, "DMI_PRODUCT_NAME", str(product))
    return product


@pytest.fixture
def on_gce(clean):
    clean.write_text("Google Compute Engine\n")


def setenv(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)


# ------------------------------------------------- what GKE and xpk write into the pods
def gke_v4_16(worker):
    """A v4-16 slice (8 chips, 2 hosts of 4) in a JobSet 'train', replicated job 'slice'."""
    return {
        "TPU_WORKER_ID": str(worker),
        "TPU_WORKER_HOSTNAMES": "train-slice-0-0.train,train-slice-0-1.train",
        "TPU_ACCELERATOR_TYPE": "v4-16",
        "TPU_TOPOLOGY": "2x2x2",
        "TPU_HOST_BOUNDS": "1,1,2",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "TPU_TOPOLOGY_WRAP": "false,false,false",
        "TPU_SKIP_MDS_QUERY": "true",
    }


def gke_v5e_16(worker, job="lite", slice_index=0):
    """A v5litepod-16 slice (16 chips, 4 hosts of 4, topology 4x4)."""
    hosts = ",".join(f"{job}-slice-{slice_index}-{i}.{job}" for i in range(4))
    return {
        "TPU_WORKER_ID": str(worker),
        "TPU_WORKER_HOSTNAMES": hosts,
        "TPU_ACCELERATOR_TYPE": "v5litepod-16",
        "TPU_TOPOLOGY": "4x4",
        "TPU_HOST_BOUNDS": "2,2,1",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "TPU_TOPOLOGY_WRAP": "false,false,false",
        "TPU_SKIP_MDS_QUERY": "true",
    }


def xpk_multislice(slice_id, worker):
    """Two v5litepod-16 slices: xpk's JobSet 'ms' with replicatedjob-replicas=2; each pod's
    MEGASCALE_SLICE_ID is its job-index, the coordinator the first pod of job 0."""
    env = gke_v5e_16(worker, job="ms", slice_index=slice_id)
    env.update(
        MEGASCALE_COORDINATOR_ADDRESS="ms-slice-0-0.ms",
        MEGASCALE_NUM_SLICES="2",
        MEGASCALE_SLICE_ID=str(slice_id),
        MEGASCALE_PORT="8080",
    )
    return env


@pytest.mark.parametrize("worker", [0, 1])
def test_v4_16_slice_on_gke(monkeypatch, worker):
    setenv(monkeypatch, gke_v4_16(worker))
    r = dt.TPUClusterResolver(tpu="")
    assert isinstance(r, dt.ClusterResolver)
    assert (r.source, r.num_processes, r.process_id) == ("environment", 2, worker)
    assert r.task_id == worker
    assert r.is_chief == (worker == 0) and r.task_type == "worker"
    assert r.coordinator_address == "train-slice-0-0.train:8482"  # the first worker's host
    assert (r.accelerator_type, r.topology) == ("v4-16", "2x2x2")
    assert (r.num_slices, r.slice_id, r.hosts_per_slice) == (1, 0, 2)
    assert r.local_device_count is None and r.local_device_ids is None
    assert "accelerator_type='v4-16'" in repr(r)


@pytest.mark.parametrize("worker", [0, 1, 2, 3])
def test_v5e_16_slice_on_gke(monkeypatch, worker):
    setenv(monkeypatch, gke_v5e_16(worker))
    r = dt.TPUClusterResolver(tpu="local")
    assert (r.num_processes, r.process_id, r.worker_id) == (4, worker, worker)
    assert r.coordinator_address == "lite-slice-0-0.lite:8482"
    assert (r.accelerator_type, r.topology) == ("v5litepod-16", "4x4")
    assert r.worker_hostnames[worker] == f"lite-slice-0-{worker}.lite"


def test_two_slice_multislice_numbers_processes_slice_by_slice(monkeypatch):
    seen = {}
    for slice_id in (0, 1):
        for worker in range(4):
            setenv(monkeypatch, xpk_multislice(slice_id, worker))
            r = dt.TPUClusterResolver()
            assert (r.num_slices, r.slice_id, r.hosts_per_slice) == (2, slice_id, 4)
            assert r.num_processes == 8
            # Every process meets at slice 0's first host, not at its own slice's first.
            assert r.coordinator_address == "ms-slice-0-0.ms:8482"
            seen[(slice_id, worker)] = r.process_id
    assert seen == {(s, w): 4 * s + w for s in (0, 1) for w in range(4)}


def test_coordinator_port_and_process_addresses(monkeypatch):
    env = gke_v4_16(1)
    del env["TPU_WORKER_HOSTNAMES"]
    env.update(
        TPU_PROCESS_ADDRESSES="10.0.0.1:8476,[fd00::2]:8476",
        TPU_PROCESS_BOUNDS="1,1,2",
        JAX_COORDINATOR_PORT="9000",
    )
    setenv(monkeypatch, env)
    r = dt.TPUClusterResolver()
    assert r.worker_hostnames == ("10.0.0.1", "fd00::2")
    assert r.coordinator_address == "10.0.0.1:9000"
    env["MEGASCALE_COORDINATOR_ADDRESS"] = "[fd00::9]:8080"
    env.update(MEGASCALE_NUM_SLICES="2", MEGASCALE_SLICE_ID="1")
    setenv(monkeypatch, env)
    r = dt.TPUClusterResolver()
    assert r.coordinator_address == "[fd00::9]:9000" and r.process_id == 3


def test_the_environment_argument_reads_a_mapping_instead():
    r = dt.TPUClusterResolver(environ=gke_v4_16(1))
    assert r.process_id == 1


def test_tpu_name_is_checked_against_tpu_name(monkeypatch):
    setenv(monkeypatch, {**gke_v4_16(0), "TPU_NAME": "my-tpu"})
    assert dt.TPUClusterResolver(tpu="my-tpu").tpu == "my-tpu"
    with pytest.raises(ValueError, match=r"tpu='other' is not this TPU's: TPU_NAME='my-tpu' \(set"):
        dt.TPUClusterResolver(tpu="other")


# --------------------------------------------------------------- errors, one per path
ERRORS = [
    (
        {"TPU_WORKER_ID": "abc"},
        r"TPU_WORKER_ID must be an integer >= 0\. Received: "
        r"TPU_WORKER_ID='abc' \(set by GKE's TPU webhook",
    ),
    (
        {"TPU_WORKER_ID": "-1"},
        r"TPU_WORKER_ID must be an integer >= 0\. Received: "
        r"TPU_WORKER_ID='-1'",
    ),
    (
        {"TPU_WORKER_HOSTNAMES": None},
        r"the slice's hosts must be given with the worker id "
        r"TPU_WORKER_ID='1'.*Expected TPU_WORKER_HOSTNAMES \(set by GKE.*Received: unset",
    ),
    (
        {"TPU_WORKER_HOSTNAMES": "a.t,,c.t"},
        r"TPU_WORKER_HOSTNAMES must be a comma-separated list.*"
        r"Received: TPU_WORKER_HOSTNAMES='a.t,,c.t' .*entry ''",
    ),
    (
        {"TPU_WORKER_ID": "2"},
        r"worker id must be in 0\.\.1, one per host of TPU_WORKER_HOSTNAMES="
        r"'train-slice-0-0.train,train-slice-0-1.train'.*Received: TPU_WORKER_ID='2'",
    ),
    (
        {"TPU_HOST_BOUNDS": "1,1,4"},
        r"host count disagrees: TPU_HOST_BOUNDS='1,1,4' \(set by GKE: "
        r"the slice's hosts per dimension\) gives 4 hosts, but TPU_WORKER_HOSTNAMES=.* lists 2",
    ),
    ({"TPU_HOST_BOUNDS": "1,x"}, r"TPU_HOST_BOUNDS must be positive integers separated by ','"),
    (
        {"TPU_TOPOLOGY": "2x2xq"},
        r"TPU_TOPOLOGY must be positive integers separated by 'x'.*"
        r"Received: TPU_TOPOLOGY='2x2xq' \(set by GKE, from the node selector",
    ),
    (
        {"MEGASCALE_NUM_SLICES": "two"},
        r"MEGASCALE_NUM_SLICES must be an integer >= 1\. Received: "
        r"MEGASCALE_NUM_SLICES='two' \(set by the multislice launcher",
    ),
    ({"MEGASCALE_NUM_SLICES": "0"}, r"MEGASCALE_NUM_SLICES must be an integer >= 1"),
    (
        {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_COORDINATOR_ADDRESS": "c"},
        r"MEGASCALE_SLICE_ID \(set by .*job-index\) must be set in a multislice job, "
        r"MEGASCALE_NUM_SLICES='2'",
    ),
    (
        {
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": "2",
            "MEGASCALE_COORDINATOR_ADDRESS": "c",
        },
        r"MEGASCALE_SLICE_ID must be in 0\.\.1 \(MEGASCALE_NUM_SLICES='2'.*Received: "
        r"MEGASCALE_SLICE_ID='2'",
    ),
    (
        {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"},
        r"MEGASCALE_COORDINATOR_ADDRESS \(set by .*the first host of slice 0\) must name the first "
        r"host of slice 0",
    ),
    (
        {"MEGASCALE_SLICE_ID": "1"},
        r"MEGASCALE_SLICE_ID='1' .* names a slice, but "
        r"MEGASCALE_NUM_SLICES says one slice \(unset\)",
    ),
    (
        {
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": "1",
            "MEGASCALE_COORDINATOR_ADDRESS": "host:port",
        },
        r"MEGASCALE_COORDINATOR_ADDRESS must be a host or 'host:port'\. Received: "
        r"MEGASCALE_COORDINATOR_ADDRESS='host:port'",
    ),
    (
        {"JAX_COORDINATOR_PORT": "http"},
        r"JAX_COORDINATOR_PORT \(set by your manifest or shell\) "
        r"must be an integer >= 1\. Received: 'http'",
    ),
]


@pytest.mark.parametrize("change, match", ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_errors_name_the_variable_its_value_and_who_sets_it(monkeypatch, change, match):
    env = gke_v4_16(1)
    for name, value in change.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = value
    setenv(monkeypatch, env)
    with pytest.raises(ValueError, match=match):
        dt.TPUClusterResolver()


def test_the_worker_id_is_checked_before_anything_else(monkeypatch):
    setenv(
        monkeypatch,
        {
            "TPU_WORKER_ID": "worker-1",
            "TPU_HOST_BOUNDS": "x",
            "MEGASCALE_NUM_SLICES": "-2",
            "TPU_TOPOLOGY": "?",
        },
    )
    with pytest.raises(ValueError, match=r"^TPUClusterResolver: TPU_WORKER_ID must be an integer"):
        dt.TPUClusterResolver()


def test_no_worker_id_off_gce_is_one_error_and_no_metadata_query(monkeypatch, metadata_server):
    # The slice's other variables are there, but the worker id is read first.
    env = gke_v4_16(0)
    del env["TPU_WORKER_ID"], env["TPU_SKIP_MDS_QUERY"]
    setenv(monkeypatch, env)
    with pytest.raises(
        ValueError,
        match=r"no TPU worker id\. Expected TPU_WORKER_ID \(set by GKE"
        r".*Received: TPU_WORKER_ID unset, and this machine is not a GCE VM \(DMI "
        r"product name 'Standard PC .*so its GCE metadata was not read.*"
        r"dt\.MultiWorkerMirroredStrategy",
    ):
        dt.TPUClusterResolver()
    assert metadata_server.requests == []
    assert not dt.TPUClusterResolver.is_present()


def test_skip_flag_on_gce_names_it(monkeypatch, on_gce, metadata_server):
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    with pytest.raises(
        ValueError,
        match=r"TPU_SKIP_MDS_QUERY='1' \(set by GKE in TPU pods, and "
        r"by JAX on a machine without TPU chips\) says not to read",
    ):
        dt.TPUClusterResolver()
    assert metadata_server.requests == []


@pytest.mark.parametrize("tpu", ["grpc://10.240.1.2:8470", "/bns/foo/tpu"])
def test_a_remote_tpu_address_is_an_error(tpu):
    with pytest.raises(
        ValueError,
        match=r"a remote TPU's address \(TensorFlow's TPU Node "
        r"architecture\)\. JAX runs on the TPU VM hosts themselves",
    ):
        dt.TPUClusterResolver(tpu=tpu)


@pytest.mark.parametrize("kwargs", [{"tpu": 3}, {"zone": ["us"]}, {"project": 1.0}])
def test_arguments_must_be_strings(kwargs):
    with pytest.raises(TypeError, match=r"must be a string or None\. Received"):
        dt.TPUClusterResolver(**kwargs)


# ---------------------------------------------------- a Cloud TPU VM's GCE metadata
class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        server = self.server
        server.requests.append((self.path, self.headers.get("Metadata-Flavor")))
        key = self.path.rsplit("/", 1)[-1]
        if self.headers.get("Metadata-Flavor") != "Google":
            self.send_response(403)
            self.end_headers()
            return
        if key in server.status:
            self.send_response(server.status[key])
            self.end_headers()
            return
        if key not in server.attributes:
            self.send_response(404)
            self.end_headers()
            return
        body = server.attributes[key].encode()
        self.send_response(200)
        if server.flavor:
            self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata_server(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.attributes, server.status, server.requests, server.flavor = {}, {}, [], True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{server.server_address[1]}")
    yield server
    server.shutdown()
    server.server_close()


def tpu_vm_v4_16(worker, endpoints="10.130.0.2,10.130.0.3", **tpu_env):
    """The metadata of worker `worker` of a v4-16 TPU VM 'my-tpu' (gcloud tpu-vm create)."""
    lines = {
        "ACCELERATOR_TYPE": "v4-16",
        "CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "HOST_BOUNDS": "1,1,2",
        "TOPOLOGY": "2x2x2",
        "NODE_ID": "my-tpu",
        "WORKER_ID": str(worker),
        "ZONE": "us-central2-b",
        "CONSUMER_PROJECT_ID": "my-project",
        **tpu_env,
    }
    return {
        "agent-worker-number": str(worker),
        "worker-network-endpoints": endpoints,
        "accelerator-type": "v4-16",
        "tpu-env": "".join(f"{k}: '{v}'\n" for k, v in lines.items()),
    }


@pytest.mark.parametrize("worker", [0, 1])
def test_cloud_tpu_vm_from_its_metadata(on_gce, metadata_server, worker):
    metadata_server.attributes = tpu_vm_v4_16(worker)
    r = dt.TPUClusterResolver(tpu="", zone="us-central2-b", project="my-project")
    assert r.source == "gce-metadata"
    assert (r.num_processes, r.process_id, r.worker_hostnames) == (
        2,
        worker,
        ("10.130.0.2", "10.130.0.3"),
    )
    assert r.coordinator_address == "10.130.0.2:8482"
    assert (r.accelerator_type, r.topology, r.num_slices) == ("v4-16", "2x2x2", 1)
    paths = [p for p, _ in metadata_server.requests]
    # The worker id is asked first; every request carries the header; nothing is asked twice.
    assert paths[0] == "/computeMetadata/v1/instance/attributes/agent-worker-number"
    assert {flavor for _, flavor in metadata_server.requests} == {"Google"}
    assert len(paths) == len(set(paths)) <= 4
    assert dt.TPUClusterResolver.is_present()


def test_cloud_tpu_vm_older_endpoint_format(on_gce, metadata_server):
    metadata_server.attributes = tpu_vm_v4_16(1, endpoints="w-0:0:10.0.0.2,w-1:1:10.0.0.3")
    assert dt.TPUClusterResolver().worker_hostnames == ("10.0.0.2", "10.0.0.3")


def test_multislice_queued_resource_from_tpu_env(on_gce, metadata_server):
    metadata_server.attributes = tpu_vm_v4_16(
        0,
        endpoints="10.1.0.2,10.1.0.3",
        MEGASCALE_COORDINATOR_ADDRESS="10.0.0.2:8080",
        MEGASCALE_NUM_SLICES="2",
        MEGASCALE_SLICE_ID="1",
    )
    r = dt.TPUClusterResolver()
    assert (r.num_slices, r.slice_id, r.process_id, r.num_processes) == (2, 1, 2, 4)
    assert r.coordinator_address == "10.0.0.2:8482"


def test_a_pod_described_by_its_environment_never_asks_the_metadata(
    monkeypatch, on_gce, metadata_server
):
    env = xpk_multislice(1, 2)
    del env["TPU_SKIP_MDS_QUERY"]  # even on a GCE VM where the server could be asked
    setenv(monkeypatch, env)
    metadata_server.attributes = tpu_vm_v4_16(0)
    assert dt.TPUClusterResolver().process_id == 6
    assert metadata_server.requests == []


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("zone", "europe-west4-a", "ZONE='us-central2-b'"),
        ("project", "other", "CONSUMER_PROJECT_ID='my-project'"),
    ],
)
def test_zone_and_project_are_checked_against_the_tpu_vm(
    on_gce, metadata_server, field, value, shown
):
    metadata_server.attributes = tpu_vm_v4_16(0)
    with pytest.raises(
        ValueError,
        match=rf"{field}='{value}' is not this TPU's: {shown} \(line "
        rf".* of the GCE metadata attribute tpu-env, set by Cloud TPU\)",
    ):
        dt.TPUClusterResolver(**{field: value})


def test_metadata_errors(on_gce, metadata_server):
    with pytest.raises(
        ValueError,
        match=r"this GCE VM has no such attribute: it is not a Cloud "
        r"TPU VM",
    ):
        dt.TPUClusterResolver()  # a GCE VM without TPUs: 404
    assert len(metadata_server.requests) == 1  # nothing else is asked
    assert not dt.TPUClusterResolver.is_present()
    metadata_server.attributes = {"agent-worker-number": "0"}
    with pytest.raises(
        ValueError,
        match=r"Expected the metadata attribute worker-network-"
        r"endpoints\. Received: unset\. This TPU VM's metadata is incomplete",
    ):
        dt.TPUClusterResolver()
    metadata_server.attributes = tpu_vm_v4_16(0, endpoints="w-0:x")
    with pytest.raises(
        ValueError,
        match=r"worker-network-endpoints must be a comma-separated list"
        r".*\(the GCE metadata attribute worker-network-endpoints, set by Cloud "
        r"TPU on each TPU VM\)",
    ):
        dt.TPUClusterResolver()
    metadata_server.attributes = tpu_vm_v4_16(0, HOST_BOUNDS="1,1,4")
    with pytest.raises(
        ValueError,
        match=r"TPU_HOST_BOUNDS='1,1,4' \(line HOST_BOUNDS of the GCE "
        r"metadata attribute tpu-env.*gives 4 hosts",
    ):
        dt.TPUClusterResolver()
    metadata_server.status = {"agent-worker-number": 500}
    with pytest.raises(RuntimeError, match=r"answered 500 .* for http://127\.0\.0\.1:\d+/compute"):
        dt.TPUClusterResolver()
    metadata_server.status, metadata_server.flavor = {}, False
    with pytest.raises(RuntimeError, match=r"without the 'Metadata-Flavor: Google' header"):
        dt.TPUClusterResolver()


def test_a_silent_metadata_server_times_out_within_a_second(monkeypatch, on_gce):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{silent.getsockname()[1]}")
        start = time.monotonic()
        with pytest.raises(
            TimeoutError,
            match=r"did not answer http://127\.0\.0\.1:\d+/computeMeta"
            r"data/v1/instance/attributes/agent-worker-number within 1 s",
        ):
            dt.TPUClusterResolver()
        assert time.monotonic() - start < 2.0
    assert gce.TIMEOUT_SECONDS <= 1.0


def test_metadata_helpers():
    assert parse_tpu_env("A: 'x'\nB: \"y\"\nnoise\nC:'z:w'\n") == {"A": "x", "B": "y", "C": "z:w"}
    md = Metadata({})
    assert not md.available and md.attribute("agent-worker-number") is None
    assert md.host == "169.254.169.254"  # the link-local address: no DNS lookup to wait for
    assert Metadata({"GCE_METADATA_IP": "10.0.0.9"}).host == "10.0.0.9"
    assert not gce.on_gce("/nonexistent/product_name")
