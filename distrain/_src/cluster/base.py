"""The cluster-resolver interface and the validation helpers every resolver shares."""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence

# distrain's own environment variables (also written by `distrain launch`).
ENV_COORDINATOR_ADDRESS = "DISTRAIN_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "DISTRAIN_NUM_PROCESSES"
# `distrain launch --islands N`: this island's id and N.
ENV_ISLAND = "DISTRAIN_ISLAND"
ENV_ISLANDS = "DISTRAIN_ISLANDS"
ENV_PROCESS_ID = "DISTRAIN_PROCESS_ID"
ENV_LOCAL_DEVICES = "DISTRAIN_LOCAL_DEVICES"
ENV_LOCAL_DEVICE_IDS = "DISTRAIN_LOCAL_DEVICE_IDS"
ENV_TF_CONFIG = "TF_CONFIG"
# `distrain launch --evaluator`: the task type of a process outside the workers' world.
ENV_TASK_TYPE = "DISTRAIN_TASK_TYPE"

# Task types TF_CONFIG may name. Only chief and worker tasks join the
# synchronous mesh; ps and evaluator tasks are described by the resolver (a
# parameter-server job or a side-car evaluator may use it) but get no process id.
SYNC_TASK_TYPES = ("chief", "worker")
TF_CONFIG_TASK_TYPES = ("chief", "worker", "ps", "evaluator")


def is_evaluator_task(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is the cluster's "evaluator" task: ``DISTRAIN_TASK_TYPE`` (set
    by ``distrain launch --evaluator``) or ``TF_CONFIG``'s task type says so.

    Read without validating the rest of ``TF_CONFIG`` (the resolver does that where a
    worker joins); text that is not JSON is not an evaluator's.

    Example:
        >>> is_evaluator_task({"TF_CONFIG": '{"task": {"type": "evaluator", "index": 0}}'})
        True
    """
    import json

    env = os.environ if environ is None else environ
    if env.get(ENV_TASK_TYPE):
        return env[ENV_TASK_TYPE] == "evaluator"
    try:
        task = json.loads(env.get(ENV_TF_CONFIG) or "{}").get("task") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(task, Mapping) and task.get("type") == "evaluator"


def parse_address(address: object, *, field: str) -> tuple[str, int]:
    """Splits "host:port" (or "[ipv6]:port") into host and port, validating both.

    Args:
        address: the address to check.
        field: where the address came from, named in the error.

    Returns:
        (host, port).

    Raises:
        ValueError: the address is not a "host:port" string with a port in 1..65535.

    Example:
        >>> parse_address("[::1]:8476", field="x")
        ('::1', 8476)
    """
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(
            f"{field} must be a 'host:port' string, e.g. '10.0.0.1:8476'. Received: {address!r}."
        )
    host, port_text = address.rsplit(":", 1)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"{field} must be a 'host:port' string with a port in 1..65535. Received: {address!r}."
        )
    return host, int(port_text)


class ClusterResolver(abc.ABC):
    """Describes the processes of a synchronous job and this process's place in it.

    Process ids are dense, 0..num_processes-1; process 0 hosts the coordinator
    and is the chief. `process_id` is None for a task outside the synchronous
    mesh (a TF_CONFIG "ps" or "evaluator" task).
    """

    @property
    @abc.abstractmethod
    def coordinator_address(self) -> str | None:
        """The "host:port" of process 0's coordinator; None when JAX detects it itself."""

    @property
    @abc.abstractmethod
    def num_processes(self) -> int:
        """Number of processes in the synchronous mesh."""

    @property
    @abc.abstractmethod
    def process_id(self) -> int | None:
        """This process's id in 0..num_processes-1, or None outside the mesh."""

    @property
    @abc.abstractmethod
    def task_type(self) -> str:
        """tf.distribute task type: "chief", "worker", "ps" or "evaluator"."""

    @property
    @abc.abstractmethod
    def task_id(self) -> int:
        """Index of this task among the tasks of its type."""

    @property
    @abc.abstractmethod
    def local_device_count(self) -> int | None:
        """Devices this process should have, or None for "whatever it has"."""

    @property
    @abc.abstractmethod
    def local_device_ids(self) -> tuple[int, ...] | None:
        """Ids of the local accelerators this process drives, or None for all."""

    @property
    def is_chief(self) -> bool:
        """Whether this process prints progress, writes logs and summaries."""
        return self.process_id == 0

    # -- TensorFlow's ClusterResolver interface (tensorflow/python/distribute/
    # cluster_resolver/cluster_resolver.py), for TF code that reads a resolver.
    @property
    def rpc_layer(self) -> str | None:
        """TF's RPC protocol of the cluster (e.g. "grpc"), or None if not given.

        JAX's coordinator speaks gRPC whatever this says; TF code reads it to
        start its own servers.
        """
        return None

    @property
    def environment(self) -> str | None:
        """TF's ``environment``: "" (TF's value outside Google's own environment)."""
        return ""

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: object = None,
    ) -> dict[str, int]:
        """This process's accelerators by kind, e.g. ``{"GPU": 8}``; ``{}`` on CPUs.

        As TF's, CPUs are not counted. It reads JAX's local devices, which starts
        JAX's backend: in a job of several processes call it once the cluster is
        joined (after creating `dt.MultiWorkerMirroredStrategy`), as TF's asks the
        running servers.

        Args:
            task_type: None or this task's type: a process sees only its own devices.
            task_id: None or this task's id.
            config_proto: unused (TF's session configuration).

        Raises:
            ValueError: ``task_type``/``task_id`` name another task.
            RuntimeError: called in a job of several processes before it was joined.
        """
        del config_proto  # a TF session option; nothing to configure here
        if (task_type is not None and task_type != self.task_type) or (
            task_id is not None and task_id != self.task_id
        ):
            raise ValueError(
                "num_accelerators() counts this process's own devices only: expected "
                f"task_type={self.task_type!r}, task_id={self.task_id} or None. Received: "
                f"task_type={task_type!r}, task_id={task_id!r}. Call it in that task."
            )
        import jax

        if self.process_id is not None and self.num_processes > 1:
            if not jax.distributed.is_initialized():
                raise RuntimeError(
                    "num_accelerators() reads this process's devices, which starts JAX's "
                    f"backend; in a job of {self.num_processes} processes that must come "
                    "after the cluster is joined. Create dt.MultiWorkerMirroredStrategy("
                    "cluster_resolver=...) first, then call it."
                )
        counts: dict[str, int] = {}
        for device in jax.local_devices():
            if device.platform != "cpu":
                kind = device.platform.upper()
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(coordinator_address={self.coordinator_address!r}, "
            f"num_processes={self.num_processes}, process_id={self.process_id}, "
            f"task_type={self.task_type!r}, task_id={self.task_id})"
        )


def check_count(value: object, *, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}. Received: {value!r}.")
    return value


def check_device_ids(value: Sequence[int] | None, *, field: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = tuple(value)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(
            f"{field} must be a non-empty list of device ids >= 0. Received: {value!r}."
        )
    return ids


def env_int(environ: Mapping[str, str], name: str, *, minimum: int, source: str = "") -> int | None:
    """Reads the integer variable `name` (None when unset or empty), checking its range.

    Args:
        environ: the environment.
        name: the variable.
        minimum: the smallest valid value.
        source: who sets the variable, named in the error (e.g. "Kubernetes").

    Raises:
        ValueError: the value is not an integer >= minimum.
    """
    text = environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        origin = f" (set by {source})" if source else ""
        raise ValueError(f"{name}{origin} must be an integer >= {minimum}. Received: {text!r}.")
    return value


class DelegatingClusterResolver(ClusterResolver):
    """A resolver that reads its sources once and answers from the cluster they describe.

    Subclasses set ``self._inner`` (usually a `SimpleClusterResolver`) in ``__init__``.
    """

    _inner: ClusterResolver

    @abc.abstractmethod
    def __init__(self, *args: object, **kwargs: object) -> None:
        """Reads the sources and sets ``self._inner``."""

    @property
    def coordinator_address(self) -> str | None:
        return self._inner.coordinator_address

    @property
    def num_processes(self) -> int:
        return self._inner.num_processes

    @property
    def process_id(self) -> int | None:
        return self._inner.process_id

    @property
    def task_type(self) -> str:
        return self._inner.task_type

    @property
    def task_id(self) -> int:
        return self._inner.task_id

    @property
    def local_device_count(self) -> int | None:
        return self._inner.local_device_count

    @property
    def local_device_ids(self) -> tuple[int, ...] | None:
        return self._inner.local_device_ids
