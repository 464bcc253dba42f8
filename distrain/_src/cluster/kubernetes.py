"""`KubernetesClusterResolver`: the cluster of a pod, from the variables Kubernetes controllers set.

Two layouts are read, without calling the Kubernetes API (a pod needs no service
account for them):

1. **Kubeflow Trainer's JAX runtime** (`ClusterTrainingRuntime` "jax-distributed", a
   `TrainJob` with `spec.trainer.numNodes` pods). Its JAX plugin
   (kubeflow/trainer `pkg/runtime/framework/plugins/jax/jax.go`; documented in
   https://www.kubeflow.org/docs/components/trainer/user-guides/jax/) sets in the
   trainer container:

   - ``JAX_NUM_PROCESSES``: ``numNodes``;
   - ``JAX_PROCESS_ID``: the pod's ``batch.kubernetes.io/job-completion-index``;
   - ``JAX_COORDINATOR_ADDRESS``: ``<trainjob>-node-0-0.<trainjob>:<port>`` (the
     first pod, through the JobSet's headless service);
   - ``JAX_COORDINATOR_PORT``, ``JAX_DISTRIBUTED_BACKEND`` ("gloo"): not needed here.

   Any launcher that sets the same three variables is read the same way.

2. **A JobSet or an Indexed Job** (what Kubeflow Trainer and xpk build on):

   - ``JOB_COMPLETION_INDEX``: set by Kubernetes itself in every pod of a Job with
     ``completionMode: Indexed`` (https://kubernetes.io/docs/concepts/workloads/
     controllers/job/#completion-mode): the pod's index in its Job.
   - ``JOBSET_NAME``, ``REPLICATED_JOB_NAME``, ``JOB_INDEX``,
     ``REPLICATED_JOB_REPLICAS``, ``JOBSET_COORDINATOR``: the JobSet controller puts
     the annotations ``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``,
     ``job-index``, ``replicatedjob-replicas`` and (with ``spec.coordinator``)
     ``coordinator`` on every pod (kubernetes-sigs/jobset
     ``api/jobset/v1alpha2/jobset_types.go``); the manifest maps them to these
     variables with the downward API (``fieldRef: metadata.annotations['...']``),
     the names xpk and pathways-job use.
   - ``DISTRAIN_NUM_PROCESSES``: the number of pods, written in the manifest:
     Kubernetes does not show a Job's ``parallelism`` to its pods (JAX's own
     Kubernetes detection reads it from the API instead).
   - The coordinator: ``DISTRAIN_COORDINATOR_ADDRESS`` if set, else
     ``JOBSET_COORDINATOR`` (``<pod hostname>.<subdomain>``), else the first pod's
     stable name, ``<jobset>-<replicated job>-0-0.<jobset>`` (JobSet's pod hostname
     ``<jobset>-<replicated job>-<job index>-<pod index>`` under its default headless
     service, named after the JobSet). The port is ``JAX_COORDINATOR_PORT``, else
     55527, JAX's own Kubernetes default, so one manifest serves both.

   Process ``JOB_INDEX * pods_per_job + JOB_COMPLETION_INDEX``, where
   ``pods_per_job = DISTRAIN_NUM_PROCESSES / REPLICATED_JOB_REPLICAS``.

A plain Indexed Job with none of these variables is left to JAX's own Kubernetes
detection (`jax[k8s]`, through the API), which `dt.AutoClusterResolver` uses.

Example:
    >>> env = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
    ...        "JAX_COORDINATOR_ADDRESS": "job-node-0-0.job:6666"}
    >>> r = KubernetesClusterResolver(env)
    >>> (r.source, r.process_id, r.coordinator_address)
    ('kubeflow', 1, 'job-node-0-0.job:6666')
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from distrain._src.cluster.base import (
    ENV_COORDINATOR_ADDRESS,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    DelegatingClusterResolver,
    env_int,
    parse_address,
)
from distrain._src.cluster.resolvers import SimpleClusterResolver, read_device_ids

ENV_JAX_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_JAX_PROCESS_ID = "JAX_PROCESS_ID"
ENV_JAX_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_JAX_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
ENV_JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
ENV_JOBSET_NAME = "JOBSET_NAME"
ENV_REPLICATED_JOB_NAME = "REPLICATED_JOB_NAME"
ENV_JOB_INDEX = "JOB_INDEX"
ENV_REPLICATED_JOB_REPLICAS = "REPLICATED_JOB_REPLICAS"
ENV_JOBSET_COORDINATOR = "JOBSET_COORDINATOR"

# JAX's K8sCluster._coordinator_port (jax/_src/clusters/k8s_cluster.py).
DEFAULT_COORDINATOR_PORT = 55527

_KUBEFLOW = "Kubeflow Trainer's JAX runtime"
_ANNOTATION = "the JobSet annotation jobset.sigs.k8s.io/{} (mapped with the downward API)"
# Who sets each variable: named in every error, so that the fix is found where it belongs.
SOURCES = {
    ENV_JAX_NUM_PROCESSES: f"{_KUBEFLOW}, from the TrainJob's spec.trainer.numNodes",
    ENV_JAX_PROCESS_ID: f"{_KUBEFLOW}, from the pod's batch.kubernetes.io/job-completion-index",
    ENV_JAX_COORDINATOR_ADDRESS: f"{_KUBEFLOW}, as '<trainjob>-node-0-0.<trainjob>:<port>'",
    ENV_JAX_COORDINATOR_PORT: "the manifest (Kubeflow Trainer's JAX runtime sets it too)",
    ENV_JOB_COMPLETION_INDEX: "Kubernetes, in every pod of an Indexed Job",
    ENV_JOBSET_NAME: _ANNOTATION.format("jobset-name"),
    ENV_REPLICATED_JOB_NAME: _ANNOTATION.format("replicatedjob-name"),
    ENV_JOB_INDEX: _ANNOTATION.format("job-index"),
    ENV_REPLICATED_JOB_REPLICAS: _ANNOTATION.format("replicatedjob-replicas"),
    ENV_JOBSET_COORDINATOR: _ANNOTATION.format("coordinator") + ", with spec.coordinator",
    ENV_NUM_PROCESSES: "the manifest: the number of pods of the job",
    ENV_COORDINATOR_ADDRESS: "the manifest",
}


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    return env_int(env, name, minimum=minimum, source=SOURCES[name])


def _named(name: str, value: object) -> str:
    return f"{name}={value} (set by {SOURCES[name]})"


class KubernetesClusterResolver(DelegatingClusterResolver):
    """The cluster of a pod started by Kubeflow Trainer's JAX runtime, a JobSet or an Indexed Job.

    See the module docstring for the variables and who sets each. Every error
    names the variable, its value and its source.

    Args:
        environ: the mapping to read; `os.environ` by default.

    Raises:
        ValueError: a variable is missing, malformed or out of range, or two
            variables disagree on the number of processes.

    Example:
        >>> env = {"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "train",
        ...        "REPLICATED_JOB_NAME": "workers", "DISTRAIN_NUM_PROCESSES": "2"}
        >>> KubernetesClusterResolver(env).coordinator_address
        'train-workers-0-0.train:55527'
    """

    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        if _kubeflow_present(env):
            self.source = "kubeflow"
            address, num, pid = _read_kubeflow(env)
        else:
            self.source = "jobset" if env.get(ENV_JOBSET_NAME) else "indexed-job"
            address, num, pid = _read_jobset(env)
        self._inner = SimpleClusterResolver(
            address,
            num,
            pid,
            env_int(env, ENV_LOCAL_DEVICES, minimum=1),
            read_device_ids(env),
            _source=f"KubernetesClusterResolver ({self.source})",
        )

    @staticmethod
    def is_present(environ: Mapping[str, str] | None = None) -> bool:
        """Whether the pod's variables describe a cluster without asking the API.

        True with Kubeflow Trainer's ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, or
        with ``JOB_COMPLETION_INDEX`` and the number of processes
        (``DISTRAIN_NUM_PROCESSES``).
        """
        env = os.environ if environ is None else environ
        return _kubeflow_present(env) or bool(
            env.get(ENV_JOB_COMPLETION_INDEX) and env.get(ENV_NUM_PROCESSES)
        )

    @staticmethod
    def is_incomplete(environ: Mapping[str, str] | None = None) -> bool:
        """Whether a JobSet pod was mapped for distrain but lacks the number of processes."""
        env = os.environ if environ is None else environ
        return bool(env.get(ENV_JOB_COMPLETION_INDEX) and env.get(ENV_JOBSET_NAME))


def _kubeflow_present(env: Mapping[str, str]) -> bool:
    return bool(env.get(ENV_JAX_NUM_PROCESSES) or env.get(ENV_JAX_PROCESS_ID))


def _read_kubeflow(env: Mapping[str, str]) -> tuple[str | None, int, int]:
    num = _int(env, ENV_JAX_NUM_PROCESSES, 1)
    pid = _int(env, ENV_JAX_PROCESS_ID, 0)
    if num is None or pid is None:
        missing, given = (
            (ENV_JAX_NUM_PROCESSES, ENV_JAX_PROCESS_ID)
            if num is None
            else (ENV_JAX_PROCESS_ID, ENV_JAX_NUM_PROCESSES)
        )
        raise ValueError(
            f"KubernetesClusterResolver: {missing} must be set together with {given} (both are "
            f"set by {_KUBEFLOW}). Received: {given}={env.get(given)!r}, {missing} unset. Run "
            "the TrainJob with the 'jax-distributed' runtime, or set both in the manifest."
        )
    _check_agrees(env, num, ENV_JAX_NUM_PROCESSES)
    if pid >= num:
        raise ValueError(
            f"KubernetesClusterResolver: {ENV_JAX_PROCESS_ID} must be in 0..{num - 1} "
            f"({_named(ENV_JAX_NUM_PROCESSES, num)}). Received: {_named(ENV_JAX_PROCESS_ID, pid)}."
            " The TrainJob has fewer nodes than pods: check spec.trainer.numNodes."
        )
    address = env.get(ENV_COORDINATOR_ADDRESS) or env.get(ENV_JAX_COORDINATOR_ADDRESS) or None
    if address is None and num > 1:
        raise ValueError(
            f"KubernetesClusterResolver: {ENV_JAX_COORDINATOR_ADDRESS} (set by {_KUBEFLOW}) must "
            f"be process 0's 'host:port' when {ENV_JAX_NUM_PROCESSES}={num}. Received: unset. "
            f"Set it (or {ENV_COORDINATOR_ADDRESS}) in the manifest."
        )
    if address is not None:
        own = bool(env.get(ENV_COORDINATOR_ADDRESS))
        name = ENV_COORDINATOR_ADDRESS if own else ENV_JAX_COORDINATOR_ADDRESS
        parse_address(address, field=f"{name} (set by {SOURCES[name]})")
    return address, num, pid


def _check_agrees(env: Mapping[str, str], num: int, name: str) -> None:
    """A DISTRAIN_NUM_PROCESSES next to the controller's own count must say the same."""
    mine = env_int(env, ENV_NUM_PROCESSES, minimum=1)
    if mine is not None and mine != num:
        raise ValueError(
            f"KubernetesClusterResolver: the number of processes disagrees: "
            f"{_named(ENV_NUM_PROCESSES, mine)} but {_named(name, num)}. Expected one number of "
            f"processes: remove {ENV_NUM_PROCESSES} from the manifest or make it {num}."
        )


def _read_jobset(env: Mapping[str, str]) -> tuple[str | None, int, int]:
    index = _int(env, ENV_JOB_COMPLETION_INDEX, 0)
    num = env_int(env, ENV_NUM_PROCESSES, minimum=1, source=SOURCES[ENV_NUM_PROCESSES])
    if index is None or num is None:
        missing = ENV_JOB_COMPLETION_INDEX if index is None else ENV_NUM_PROCESSES
        raise ValueError(
            f"KubernetesClusterResolver: {missing} must be set in a JobSet or Indexed Job pod "
            f"({SOURCES[missing]}). Received: unset. "
            + (
                "Use completionMode: Indexed."
                if index is None
                else f"Write the number of pods into the manifest as {ENV_NUM_PROCESSES} "
                "(Kubernetes does not show a Job's parallelism to its pods), or install "
                "jax[k8s] and give the pod a service account that may read pods and jobs, "
                "for JAX's own detection."
            )
        )
    replicas = _int(env, ENV_REPLICATED_JOB_REPLICAS, 1) or 1
    if num % replicas:
        raise ValueError(
            f"KubernetesClusterResolver: the number of processes disagrees with the JobSet: "
            f"{_named(ENV_NUM_PROCESSES, num)} is not a multiple of "
            f"{_named(ENV_REPLICATED_JOB_REPLICAS, replicas)}. Expected replicas x parallelism "
            f"pods: set {ENV_NUM_PROCESSES} to the total number of pods."
        )
    per_job = num // replicas
    job = _int(env, ENV_JOB_INDEX, 0)
    if job is None:
        if replicas > 1:
            raise ValueError(
                f"KubernetesClusterResolver: {ENV_JOB_INDEX} (set by {SOURCES[ENV_JOB_INDEX]}) "
                f"must be set when {_named(ENV_REPLICATED_JOB_REPLICAS, replicas)}. "
                "Received: unset."
            )
        job = 0
    if job >= replicas:
        raise ValueError(
            f"KubernetesClusterResolver: {ENV_JOB_INDEX} must be in 0..{replicas - 1} "
            f"({_named(ENV_REPLICATED_JOB_REPLICAS, replicas)}). Received: "
            f"{_named(ENV_JOB_INDEX, job)}."
        )
    if index >= per_job:
        raise ValueError(
            f"KubernetesClusterResolver: {ENV_JOB_COMPLETION_INDEX} must be in 0..{per_job - 1} "
            f"({_named(ENV_NUM_PROCESSES, num)} over {replicas} job(s) of {per_job} pods). "
            f"Received: {_named(ENV_JOB_COMPLETION_INDEX, index)}. Expected {ENV_NUM_PROCESSES} "
            "to count every pod: make it replicas x parallelism."
        )
    return _jobset_coordinator(env, num), num, job * per_job + index


def _jobset_coordinator(env: Mapping[str, str], num: int) -> str | None:
    port = _int(env, ENV_JAX_COORDINATOR_PORT, 1) or DEFAULT_COORDINATOR_PORT
    if env.get(ENV_COORDINATOR_ADDRESS):
        name, address = ENV_COORDINATOR_ADDRESS, env[ENV_COORDINATOR_ADDRESS]
    elif env.get(ENV_JOBSET_COORDINATOR):
        name, address = ENV_JOBSET_COORDINATOR, f"{env[ENV_JOBSET_COORDINATOR]}:{port}"
    elif env.get(ENV_JOBSET_NAME) and env.get(ENV_REPLICATED_JOB_NAME):
        jobset, rjob = env[ENV_JOBSET_NAME], env[ENV_REPLICATED_JOB_NAME]
        name, address = ENV_JOBSET_NAME, f"{jobset}-{rjob}-0-0.{jobset}:{port}"
    elif num == 1:
        return None
    else:
        raise ValueError(
            f"KubernetesClusterResolver: no coordinator for {_named(ENV_NUM_PROCESSES, num)}. "
            f"Expected {ENV_COORDINATOR_ADDRESS} ('<job>-0.<headless service>:<port>' for an "
            f"Indexed Job), {ENV_JOBSET_COORDINATOR}, or {ENV_JOBSET_NAME} and "
            f"{ENV_REPLICATED_JOB_NAME} from the JobSet annotations. Received: none of them."
        )
    parse_address(address, field=f"{name} (set by {SOURCES[name]})")
    return address
