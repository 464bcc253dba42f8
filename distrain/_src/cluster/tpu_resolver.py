"""`TPUClusterResolver`: the hosts of a Cloud TPU slice (or several), from what a TPU VM provides.

JAX runs one process per TPU VM host; the processes of a slice are its hosts in worker
order, and with **multislice** the slices one after another (process
``slice_id * hosts_per_slice + worker_id``, as JAX numbers them). The first host of the
first slice runs the coordinator, on JAX's port for TPU clusters (8482, or
``JAX_COORDINATOR_PORT``).

What is read, in this order (the worker id first: without one this is not a TPU host,
and nothing else is asked):

1. **The worker id**: ``TPU_WORKER_ID`` (GKE sets it in every pod of a multi-host TPU
   slice), else, on a GCE VM only (its DMI product name, read without the network) and
   unless ``TPU_SKIP_MDS_QUERY`` is set, the GCE metadata attribute
   ``agent-worker-number`` of a TPU VM (``gcloud compute tpus tpu-vm create`` or a
   queued resource), with a one-second timeout (``gce.py``).
2. **The slice's hosts**, from the same source: ``TPU_PROCESS_ADDRESSES`` (several
   processes per host, ``host:port`` each) else ``TPU_WORKER_HOSTNAMES`` (GKE: the
   pods' hostnames in worker order); or the metadata attribute
   ``worker-network-endpoints``.
3. **The slice's shape**, to describe it and to check the host count:
   ``TPU_ACCELERATOR_TYPE`` (e.g. ``v4-16``, ``v5litepod-16``), ``TPU_TOPOLOGY`` (e.g.
   ``2x2x2``), ``TPU_PROCESS_BOUNDS`` else ``TPU_HOST_BOUNDS`` (hosts per dimension:
   their product is the number of hosts); on a TPU VM, the attribute
   ``accelerator-type`` and the ``tpu-env`` lines ``TOPOLOGY`` and ``HOST_BOUNDS``.
4. **Multislice**: ``MEGASCALE_NUM_SLICES``, ``MEGASCALE_SLICE_ID`` and
   ``MEGASCALE_COORDINATOR_ADDRESS`` (the first host of slice 0), from the environment
   (xpk's JobSet, Ray, a launcher) or, on a TPU VM, the same lines of ``tpu-env`` (a
   multislice queued resource). Without them: one slice.

A slice described by the environment (a GKE pod) is read from the environment alone: the
metadata server is asked only for a TPU VM's own worker id and what goes with it.

Every error names the variable (or metadata attribute), its value and who sets it.

Example:
    >>> env = {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "t-0.t,t-1.t",
    ...        "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_SKIP_MDS_QUERY": "true"}
    >>> r = TPUClusterResolver(environ=env)
    >>> (r.process_id, r.num_processes, r.coordinator_address)
    (1, 2, 't-0.t:8482')
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from distrain._src.cluster.base import DelegatingClusterResolver, env_int, parse_address
from distrain._src.cluster.gce import Metadata
from distrain._src.cluster.kubernetes import ENV_JAX_COORDINATOR_PORT
from distrain._src.cluster.resolvers import SimpleClusterResolver

ENV_WORKER_ID = "TPU_WORKER_ID"
ENV_WORKER_HOSTNAMES = "TPU_WORKER_HOSTNAMES"
ENV_PROCESS_ADDRESSES = "TPU_PROCESS_ADDRESSES"
ENV_ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"
ENV_TOPOLOGY = "TPU_TOPOLOGY"
ENV_HOST_BOUNDS = "TPU_HOST_BOUNDS"
ENV_PROCESS_BOUNDS = "TPU_PROCESS_BOUNDS"
ENV_TPU_NAME = "TPU_NAME"
ENV_MEGASCALE_COORDINATOR = "MEGASCALE_COORDINATOR_ADDRESS"
ENV_MEGASCALE_NUM_SLICES = "MEGASCALE_NUM_SLICES"
ENV_MEGASCALE_SLICE_ID = "MEGASCALE_SLICE_ID"

MD_WORKER_NUMBER = "agent-worker-number"
MD_ENDPOINTS = "worker-network-endpoints"
MD_ACCELERATOR_TYPE = "accelerator-type"

# JAX's coordinator port for the TPU clusters it detects (jax/_src/clusters/cloud_tpu_cluster.py).
DEFAULT_COORDINATOR_PORT = 8482
LOCAL_NAMES = (None, "", "local")

_GKE = "GKE's TPU webhook, in each pod of a multi-host TPU slice (an Indexed Job or JobSet)"
_MULTISLICE = "the multislice launcher (xpk's JobSet, Ray, or your manifest)"
SOURCES = {
    ENV_WORKER_ID: f"{_GKE}: the pod's index in its slice",
    ENV_WORKER_HOSTNAMES: f"{_GKE}: the slice's pod hostnames in worker order",
    ENV_PROCESS_ADDRESSES: "the launcher, for several processes per TPU host ('host:port' each)",
    ENV_ACCELERATOR_TYPE: "GKE, from the node pool's TPU type",
    ENV_TOPOLOGY: "GKE, from the node selector cloud.google.com/gke-tpu-topology",
    ENV_HOST_BOUNDS: "GKE: the slice's hosts per dimension",
    ENV_PROCESS_BOUNDS: "the launcher, with TPU_PROCESS_ADDRESSES",
    ENV_TPU_NAME: "the pod's manifest or KubeRay's TPU webhook",
    ENV_MEGASCALE_COORDINATOR: f"{_MULTISLICE}: the first host of slice 0",
    ENV_MEGASCALE_NUM_SLICES: f"{_MULTISLICE}: the JobSet's replicatedjob-replicas",
    ENV_MEGASCALE_SLICE_ID: f"{_MULTISLICE}: the JobSet's job-index",
    ENV_JAX_COORDINATOR_PORT: "your manifest or shell",
}
_METADATA = "the GCE metadata attribute {}, set by Cloud TPU on each TPU VM"
_TPU_ENV = "line {} of the GCE metadata attribute tpu-env, set by Cloud TPU"


@dataclasses.dataclass(frozen=True)
class _Value:
    """A value read, with its name and where it came from (for error messages)."""

    name: str
    text: str
    origin: str

    def __str__(self) -> str:
        return f"{self.name}={self.text!r} ({self.origin})"


class _Reader:
    def __init__(self, env: Mapping[str, str], metadata: Metadata):
        self.env_map, self.metadata = env, metadata

    def env(self, name: str) -> _Value | None:
        text = self.env_map.get(name)
        if text is None or not text.strip():
            return None
        return _Value(name, text.strip(), f"set by {SOURCES[name]}")

    def attribute(self, key: str) -> _Value | None:
        text = self.metadata.attribute(key)
        return None if not text else _Value(key, text, _METADATA.format(key))

    def tpu_env(self, key: str, name: str | None = None) -> _Value | None:
        text = self.metadata.tpu_env(key) if self.metadata.available else None
        return None if not text else _Value(name or key, text, _TPU_ENV.format(key))

    def env_or_tpu_env(self, name: str, key: str | None = None) -> _Value | None:
        return self.env(name) or self.tpu_env(key or name, name)


def _int(value: _Value, minimum: int) -> int:
    try:
        number = int(value.text)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ValueError(
            f"TPUClusterResolver: {value.name} must be an integer >= {minimum}. Received: {value}."
        )
    return number


def _host(entry: str) -> str:
    """The host of "host", "host:port", "[v6]:port" or a bare IPv6 address."""
    if entry.startswith("[") or entry.count(":") == 1:
        return parse_address(entry, field="address")[0]
    return entry


def _hosts(value: _Value) -> tuple[str, ...]:
    out = []
    for raw in value.text.split(","):
        entry = raw.strip()
        if value.name == MD_ENDPOINTS and entry.count(":") == 2:
            entry = entry.rsplit(":", 1)[1]  # the older "name:id:ip" form
        try:
            host = _host(entry) if entry else ""
        except ValueError:
            host = ""
        if not host:
            raise ValueError(
                f"TPUClusterResolver: {value.name} must be a comma-separated list of host names "
                f"or addresses, one per host of the slice. Received: {value} (entry {raw!r})."
            )
        out.append(host)
    return tuple(out)


def _dims(value: _Value, sep: str) -> tuple[int, ...]:
    parts = value.text.lower().split(sep)
    if not 1 <= len(parts) <= 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        example = "'2,2,1'" if sep == "," else "'2x2x2' or '4x4'"
        raise ValueError(
            f"TPUClusterResolver: {value.name} must be positive integers separated by "
            f"{sep!r}, e.g. {example}. Received: {value}."
        )
    return tuple(int(p) for p in parts)


class TPUClusterResolver(DelegatingClusterResolver):
    """The hosts of a Cloud TPU slice, or of a multislice job, read on a TPU VM or GKE TPU pod.

    TensorFlow's ``tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")``. JAX runs
    on the TPU hosts themselves (one process per host, every host runs the program), so
    there is no remote TPU to connect to: ``tpu`` is this machine's TPU. See the module
    docstring for what is read and in which order; every error names the variable, its
    value and who sets it.

    Args:
        tpu: None, ``""`` or ``"local"`` (this TPU VM), or the TPU's name, which is
            checked against ``TPU_NAME`` when that is set; a ``grpc://`` address (TF's
            remote TPU) is an error.
        zone: the TPU's zone, checked against the ``ZONE`` of the TPU VM's metadata when
            it is read (TF looked the TPU up by name in this zone).
        project: the TPU's project, checked against ``CONSUMER_PROJECT_ID`` likewise.
        environ: the mapping to read; `os.environ` by default.

    Attributes:
        source: where the slice was read: "environment" (GKE, a launcher) or
            "gce-metadata" (a Cloud TPU VM).
        worker_id: this host's index in its slice.
        worker_hostnames: the slice's hosts, in worker order.
        accelerator_type: e.g. "v4-16" or "v5litepod-16" (None if not given).
        topology: e.g. "2x2x2" or "4x4" (None if not given).
        num_slices: slices of a multislice job (1 without multislice).
        slice_id: this host's slice.
        tpu: the TPU's name as given (None for this VM's), zone and project likewise.

    Raises:
        ValueError: no worker id (not a TPU host), or a variable that is missing,
            malformed, out of range or disagrees with another.
        TimeoutError: on a GCE VM, the metadata server did not answer within a second.
        TypeError: ``tpu``, ``zone`` or ``project`` is not a string.

    Example:
        >>> r = TPUClusterResolver(tpu="", environ={  # on a TPU host: TPUClusterResolver(tpu="")
        ...     "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "t-0.t,t-1.t",
        ...     "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_SKIP_MDS_QUERY": "true"})
        >>> r.accelerator_type, r.num_processes, r.is_chief
        ('v4-16', 2, True)
    """

    source: str
    worker_id: int
    worker_hostnames: tuple[str, ...]
    accelerator_type: str | None
    topology: str | None
    num_slices: int
    slice_id: int
    tpu: str | None
    zone: str | None
    project: str | None

    def __init__(
        self,
        tpu: str | None = None,
        zone: str | None = None,
        project: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ):
        for field, given in (("tpu", tpu), ("zone", zone), ("project", project)):
            if given is not None and not isinstance(given, str):
                raise TypeError(
                    f"TPUClusterResolver: {field} must be a string or None. Received: "
                    f"{type(given).__name__} {given!r}."
                )
        if tpu is not None and (tpu.startswith("grpc://") or tpu.startswith("/bns")):
            raise ValueError(
                f"TPUClusterResolver: tpu must be None, '', 'local' or this TPU's name. "
                f"Received: tpu={tpu!r}, a remote TPU's address (TensorFlow's TPU Node "
                "architecture). JAX runs on the TPU VM hosts themselves: start the program "
                "on every host of the TPU (gcloud compute tpus tpu-vm ssh NAME --worker=all "
                "--command=...) and drop the argument."
            )
        env = os.environ if environ is None else environ
        self._metadata = Metadata(env)
        read = _Reader(env, self._metadata)
        worker = self._read_worker_id(read)
        self.worker_id = _int(worker, 0)
        from_env = self.source == "environment"
        hosts = (
            read.env(ENV_PROCESS_ADDRESSES) or read.env(ENV_WORKER_HOSTNAMES)
            if from_env
            else read.attribute(MD_ENDPOINTS)
        )
        if hosts is None:
            expected, fix = (
                (
                    f"{ENV_WORKER_HOSTNAMES} (set by {SOURCES[ENV_WORKER_HOSTNAMES]})",
                    "Run the pods as an Indexed Job or JobSet with a subdomain (GKE then sets "
                    "both), or set it in the manifest",
                )
                if from_env
                else (
                    f"the metadata attribute {MD_ENDPOINTS}",
                    f"This TPU VM's metadata is incomplete: set {ENV_WORKER_ID} and "
                    f"{ENV_WORKER_HOSTNAMES} in the environment instead",
                )
            )
            raise ValueError(
                f"TPUClusterResolver: the slice's hosts must be given with the worker id "
                f"{worker}. Expected {expected}. Received: unset. {fix}."
            )
        self.worker_hostnames = _hosts(hosts)
        if self.worker_id >= len(self.worker_hostnames):
            raise ValueError(
                f"TPUClusterResolver: the worker id must be in 0..{len(self.worker_hostnames) - 1}"
                f", one per host of {hosts}. Received: {worker}. Expected as many hosts as "
                "workers: check the job's parallelism against the slice's hosts."
            )
        self._check_bounds(read, hosts, from_env)
        self.accelerator_type = _text(
            read.env(ENV_ACCELERATOR_TYPE)
            or (None if from_env else read.attribute(MD_ACCELERATOR_TYPE))
            or (None if from_env else read.tpu_env("ACCELERATOR_TYPE", ENV_ACCELERATOR_TYPE))
        )
        topology = read.env(ENV_TOPOLOGY) or (
            None if from_env else read.tpu_env("TOPOLOGY", ENV_TOPOLOGY)
        )
        if topology is not None:
            _dims(topology, "x")
        self.topology = _text(topology)
        coordinator = self._read_slices(read, from_env)
        self.tpu = None if tpu in LOCAL_NAMES else tpu
        self.zone, self.project = zone, project
        self._check_identity(read)
        port_source = SOURCES[ENV_JAX_COORDINATOR_PORT]
        port = env_int(env, ENV_JAX_COORDINATOR_PORT, minimum=1, source=port_source)
        port = port or DEFAULT_COORDINATOR_PORT
        host = coordinator if coordinator is not None else self.worker_hostnames[0]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        hosts_per_slice = len(self.worker_hostnames)
        self._inner = SimpleClusterResolver(
            address,
            self.num_slices * hosts_per_slice,
            self.slice_id * hosts_per_slice + self.worker_id,
            _source="TPUClusterResolver",
        )

    def _read_worker_id(self, read: _Reader) -> _Value:
        worker = read.env(ENV_WORKER_ID)
        if worker is not None:
            self.source = "environment"
            return worker
        md = read.metadata
        if not md.available:
            raise ValueError(
                f"TPUClusterResolver: no TPU worker id. Expected {ENV_WORKER_ID} (set by "
                f"{SOURCES[ENV_WORKER_ID]}) or, on a Cloud TPU VM, the GCE metadata attribute "
                f"{MD_WORKER_NUMBER}. Received: {ENV_WORKER_ID} unset, and {md.why_not()}. "
                "Run on a Cloud TPU VM or in a GKE TPU pod; on one host without these, set "
                f"{ENV_WORKER_ID}=0 and {ENV_WORKER_HOSTNAMES}=localhost; on CPUs and GPUs use "
                "dt.MultiWorkerMirroredStrategy with its resolvers."
            )
        value = read.attribute(MD_WORKER_NUMBER)
        if value is None:
            raise ValueError(
                f"TPUClusterResolver: no TPU worker id. Expected {ENV_WORKER_ID} or the GCE "
                f"metadata attribute {MD_WORKER_NUMBER} (at {md.url(MD_WORKER_NUMBER)}). "
                f"Received: {ENV_WORKER_ID} unset, and this GCE VM has no such attribute: it "
                "is not a Cloud TPU VM. Run on the TPU VM's hosts (gcloud compute tpus "
                "tpu-vm ssh NAME --worker=all) or in a GKE TPU pod."
            )
        self.source = "gce-metadata"
        return value

    def _check_bounds(self, read: _Reader, hosts: _Value, from_env: bool) -> None:
        bounds = read.env(ENV_PROCESS_BOUNDS) or read.env(ENV_HOST_BOUNDS)
        if bounds is None and not from_env:
            bounds = read.tpu_env("HOST_BOUNDS", ENV_HOST_BOUNDS)
        if bounds is None:
            return
        expected = math.prod(_dims(bounds, ","))
        if expected != len(self.worker_hostnames):
            raise ValueError(
                f"TPUClusterResolver: the slice's host count disagrees: {bounds} gives "
                f"{expected} hosts, but {hosts} lists {len(self.worker_hostnames)}. Expected one "
                "host name per host of the slice: check the job's parallelism and the TPU "
                "topology of its node selector."
            )

    def _read_slices(self, read: _Reader, from_env: bool) -> str | None:
        """Sets num_slices and slice_id; returns the multislice coordinator's host."""
        get = read.env if from_env else read.env_or_tpu_env
        num = get(ENV_MEGASCALE_NUM_SLICES)
        sid = get(ENV_MEGASCALE_SLICE_ID)
        self.num_slices = 1 if num is None else _int(num, 1)
        self.slice_id = 0 if sid is None else _int(sid, 0)
        if self.num_slices == 1:
            if self.slice_id:
                raise ValueError(
                    f"TPUClusterResolver: {sid} names a slice, but {ENV_MEGASCALE_NUM_SLICES} "
                    f"says one slice ({num if num is not None else 'unset'}). Expected both "
                    f"for a multislice job: set {ENV_MEGASCALE_NUM_SLICES} to the number of "
                    "slices."
                )
            return None
        if sid is None:
            raise ValueError(
                f"TPUClusterResolver: {ENV_MEGASCALE_SLICE_ID} (set by "
                f"{SOURCES[ENV_MEGASCALE_SLICE_ID]}) must be set in a multislice job, {num}. "
                "Received: unset."
            )
        if self.slice_id >= self.num_slices:
            raise ValueError(
                f"TPUClusterResolver: {ENV_MEGASCALE_SLICE_ID} must be in "
                f"0..{self.num_slices - 1} ({num}). Received: {sid}."
            )
        address = get(ENV_MEGASCALE_COORDINATOR)
        if address is None:
            raise ValueError(
                f"TPUClusterResolver: {ENV_MEGASCALE_COORDINATOR} (set by "
                f"{SOURCES[ENV_MEGASCALE_COORDINATOR]}) must name the first host of slice 0 "
                f"in a multislice job, {num}. Received: unset."
            )
        try:
            return _host(address.text)
        except ValueError:
            raise ValueError(
                f"TPUClusterResolver: {ENV_MEGASCALE_COORDINATOR} must be a host or "
                f"'host:port'. Received: {address}."
            ) from None

    def _check_identity(self, read: _Reader) -> None:
        checks = [("tpu", self.tpu, read.env(ENV_TPU_NAME))]
        if self.source == "gce-metadata":
            checks += [
                ("zone", self.zone, read.tpu_env("ZONE")),
                ("project", self.project, read.tpu_env("CONSUMER_PROJECT_ID")),
            ]
        for field, given, found in checks:
            if given and found is not None and found.text != given:
                raise ValueError(
                    f"TPUClusterResolver: {field}={given!r} is not this TPU's: {found}. JAX "
                    "runs on the TPU it is started on; start the program on that TPU's hosts, "
                    f"or drop the {field} argument."
                )

    @staticmethod
    def is_present(environ: Mapping[str, str] | None = None) -> bool:
        """Whether a TPU worker id can be read: ``TPU_WORKER_ID``, or on a GCE VM the
        metadata attribute ``agent-worker-number`` (one request, at most a second)."""
        env = os.environ if environ is None else environ
        if env.get(ENV_WORKER_ID, "").strip():
            return True
        metadata = Metadata(env)
        return metadata.available and metadata.attribute(MD_WORKER_NUMBER) is not None

    @property
    def hosts_per_slice(self) -> int:
        """Hosts (processes) per slice."""
        return len(self.worker_hostnames)

    def __repr__(self) -> str:
        return (
            f"TPUClusterResolver(accelerator_type={self.accelerator_type!r}, "
            f"topology={self.topology!r}, num_slices={self.num_slices}, "
            f"slice_id={self.slice_id}, worker_id={self.worker_id}, "
            f"process_id={self.process_id}, num_processes={self.num_processes}, "
            f"coordinator_address={self.coordinator_address!r})"
        )


def _text(value: _Value | None) -> str | None:
    return None if value is None else value.text
