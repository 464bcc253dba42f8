"""Cluster resolvers: who the processes of a synchronous job are and which one this is.

A resolver answers the questions `jax.distributed.initialize` needs (the
coordinator's address, how many processes, this process's id, which local
devices it drives) plus the tf.distribute ones (task type, task id, chief).
It only reads configuration; it never starts anything. `initialize_distributed`
(in `distrain/_src/cluster/runtime.py`) turns a resolver into a running JAX cluster.

Sources, in the order `resolve_cluster()` tries them:

1. `EnvClusterResolver`: distrain's own variables, set by `distrain launch`
   or by hand (`DISTRAIN_COORDINATOR_ADDRESS`, `DISTRAIN_NUM_PROCESSES`,
   `DISTRAIN_PROCESS_ID`, optional `DISTRAIN_LOCAL_DEVICES`,
   `DISTRAIN_LOCAL_DEVICE_IDS`).
2. `TFConfigClusterResolver`: TensorFlow's `TF_CONFIG` JSON, unchanged.
3. `RayTrainClusterResolver` (ray_train.py): a Ray Train worker group.
4. `KubernetesClusterResolver` (kubernetes.py): Kubeflow Trainer's JAX runtime,
   a JobSet or an Indexed Job.
5. `AutoClusterResolver`: whatever `jax.distributed` detects by itself
   (Slurm, Open MPI, Cloud TPU, ...); a single process when nothing is found.

Example:
    >>> r = SimpleClusterResolver("10.0.0.1:1234", num_processes=2, process_id=1)
    >>> (r.task_type, r.task_id, r.is_chief)
    ('worker', 1, False)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from distrain._src.cluster.base import (
    ENV_COORDINATOR_ADDRESS,
    ENV_LOCAL_DEVICE_IDS,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ClusterResolver,
    DelegatingClusterResolver,
    check_count,
    check_device_ids,
    env_int,
    parse_address,
)


class SimpleClusterResolver(ClusterResolver):
    """A cluster given explicitly in code (task type "worker", task id = process id).

    Args:
        coordinator_address: "host:port" of process 0; may be None for one process.
        num_processes: number of processes, >= 1.
        process_id: this process's id, 0 <= process_id < num_processes.
        local_device_count: devices each process must have (on CPU, how many
            virtual devices to create), or None.
        local_device_ids: local accelerator ids this process drives, or None.

    Raises:
        ValueError: a value is out of range or the address is malformed.

    Example:
        >>> SimpleClusterResolver("127.0.0.1:1234", 2, 0).is_chief
        True
    """

    def __init__(
        self,
        coordinator_address: str | None,
        num_processes: int,
        process_id: int,
        local_device_count: int | None = None,
        local_device_ids: Sequence[int] | None = None,
        *,
        _source: str = "SimpleClusterResolver",
    ):
        self._num_processes = check_count(
            num_processes, field=f"{_source}: num_processes", minimum=1
        )
        self._process_id = check_count(process_id, field=f"{_source}: process_id", minimum=0)
        if process_id >= num_processes:
            raise ValueError(
                f"{_source}: process_id must be in 0..num_processes-1 = 0..{num_processes - 1}. "
                f"Received: process_id={process_id}, num_processes={num_processes}."
            )
        if coordinator_address is None and num_processes > 1:
            raise ValueError(
                f"{_source}: a coordinator address ('host:port' of process 0) is required "
                f"when num_processes > 1. Received: num_processes={num_processes} "
                "and no address."
            )
        if coordinator_address is not None:
            parse_address(coordinator_address, field=f"{_source}: coordinator_address")
        self._address = coordinator_address
        self._local_device_count = (
            None
            if local_device_count is None
            else check_count(local_device_count, field=f"{_source}: local_device_count", minimum=1)
        )
        self._local_device_ids = check_device_ids(
            local_device_ids, field=f"{_source}: local_device_ids"
        )

    @property
    def coordinator_address(self) -> str | None:
        return self._address

    @property
    def num_processes(self) -> int:
        return self._num_processes

    @property
    def process_id(self) -> int:
        return self._process_id

    @property
    def task_type(self) -> str:
        # TensorFlow's convention without a "chief" task: worker 0 is the chief.
        return "worker"

    @property
    def task_id(self) -> int:
        return self._process_id

    @property
    def local_device_count(self) -> int | None:
        return self._local_device_count

    @property
    def local_device_ids(self) -> tuple[int, ...] | None:
        return self._local_device_ids


def read_device_ids(environ: Mapping[str, str]) -> list[int] | None:
    """DISTRAIN_LOCAL_DEVICE_IDS as a list of ints (None when unset)."""
    ids_text = environ.get(ENV_LOCAL_DEVICE_IDS, "").strip()
    if not ids_text:
        return None
    try:
        return [int(part) for part in ids_text.split(",")]
    except ValueError:
        raise ValueError(
            f"{ENV_LOCAL_DEVICE_IDS} must be comma-separated integers, e.g. '0,1'. "
            f"Received: {ids_text!r}."
        ) from None


class EnvClusterResolver(DelegatingClusterResolver):
    """Reads the cluster from distrain's environment variables.

    Variables (all set by `distrain launch`):
      - DISTRAIN_COORDINATOR_ADDRESS: "host:port" of process 0 (required when
        DISTRAIN_NUM_PROCESSES > 1);
      - DISTRAIN_NUM_PROCESSES: number of processes (default 1);
      - DISTRAIN_PROCESS_ID: this process's id (required when more than one);
      - DISTRAIN_LOCAL_DEVICES: devices per process (optional; on CPU, the
        number of virtual devices to create);
      - DISTRAIN_LOCAL_DEVICE_IDS: comma-separated local accelerator ids (optional).

    Args:
        environ: the mapping to read; `os.environ` by default.

    Raises:
        ValueError: a variable is missing, not an integer, or out of range.

    Example:
        >>> env = {"DISTRAIN_COORDINATOR_ADDRESS": "127.0.0.1:1234",
        ...        "DISTRAIN_NUM_PROCESSES": "2", "DISTRAIN_PROCESS_ID": "1"}
        >>> EnvClusterResolver(env).process_id
        1
    """

    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        num = env_int(env, ENV_NUM_PROCESSES, minimum=1)
        pid = env_int(env, ENV_PROCESS_ID, minimum=0)
        address = env.get(ENV_COORDINATOR_ADDRESS) or None
        if num is None:
            if address is None and pid is None:
                num = 1
            else:
                raise ValueError(
                    f"{ENV_NUM_PROCESSES} must be set when {ENV_COORDINATOR_ADDRESS} or "
                    f"{ENV_PROCESS_ID} is. Received: {ENV_COORDINATOR_ADDRESS}={address!r}, "
                    f"{ENV_PROCESS_ID}={env.get(ENV_PROCESS_ID)!r}, {ENV_NUM_PROCESSES} unset."
                )
        if pid is None:
            if num > 1:
                raise ValueError(
                    f"{ENV_PROCESS_ID} must be set (0..{num - 1}) when "
                    f"{ENV_NUM_PROCESSES}={num}. Received: {ENV_PROCESS_ID} unset."
                )
            pid = 0
        if pid >= num:
            raise ValueError(
                f"{ENV_PROCESS_ID} must be in 0..{num - 1} ({ENV_NUM_PROCESSES}={num}). "
                f"Received: {ENV_PROCESS_ID}={pid}."
            )
        if address is None and num > 1:
            raise ValueError(
                f"{ENV_COORDINATOR_ADDRESS} must be set to process 0's 'host:port' when "
                f"{ENV_NUM_PROCESSES}={num}. Received: {ENV_COORDINATOR_ADDRESS} unset."
            )
        if address is not None:
            parse_address(address, field=ENV_COORDINATOR_ADDRESS)
        self._inner = SimpleClusterResolver(
            address,
            num,
            pid,
            env_int(env, ENV_LOCAL_DEVICES, minimum=1),
            read_device_ids(env),
            _source="EnvClusterResolver",
        )

    @staticmethod
    def is_present(environ: Mapping[str, str] | None = None) -> bool:
        """Whether any of distrain's cluster variables is set."""
        env = os.environ if environ is None else environ
        return any(
            env.get(name) for name in (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        )


def _detected_environment() -> Any:
    """The cluster environment `jax.distributed` would auto-detect, or None.

    Uses JAX's registry of cluster environments (private, hence the guard): the
    same list `jax.distributed.initialize()` walks when called without arguments.
    """
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - depends on the JAX version
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return env
        except Exception:  # noqa: BLE001 - a broken probe means "not this environment"
            continue
    return None


class AutoClusterResolver(ClusterResolver):
    """Defers to what `jax.distributed` detects by itself: Slurm, Open MPI, Cloud TPU, ...

    `coordinator_address` is None: JAX derives it from the scheduler. When no
    scheduler is detected the job is a single process (process 0 of 1).

    Example:
        >>> AutoClusterResolver().num_processes >= 1
        True
    """

    def __init__(self) -> None:
        self._env = _detected_environment()

    @property
    def environment(self) -> str | None:
        """Name of the detected scheduler (e.g. "slurm"), or None."""
        return None if self._env is None else (self._env.name or self._env.__name__)

    def _jax_initialized(self) -> bool:
        import jax

        return jax.distributed.is_initialized()

    @property
    def coordinator_address(self) -> str | None:
        return None

    @property
    def num_processes(self) -> int:
        if self._jax_initialized():
            import jax

            return jax.process_count()
        return 1 if self._env is None else int(self._env.get_process_count())

    @property
    def process_id(self) -> int:
        if self._jax_initialized():
            import jax

            return jax.process_index()
        return 0 if self._env is None else int(self._env.get_process_id())

    @property
    def task_type(self) -> str:
        return "worker"

    @property
    def task_id(self) -> int:
        return self.process_id

    @property
    def local_device_count(self) -> int | None:
        return None

    @property
    def local_device_ids(self) -> tuple[int, ...] | None:
        return None
