"""`RayTrainClusterResolver`: the cluster of a Ray Train worker group.

A distrain program runs as the ``train_loop_per_worker`` of Ray Train's
`ray.train.v2.jax.JaxTrainer` (or any Ray Train trainer). Ray gives each worker its
rank and the group's size (`ray.train.get_context()`); the coordinator address is
agreed on at start: worker 0 picks a free port on its node's address
(`ray.util.get_node_ip_address()`) and hands it to the others with Ray Train's own
`ray.train.collective.broadcast_from_rank_zero`, a barrier of the group (a worker
that dies before it ends the attempt through Ray's failure handling, not a hang).

Where Ray's JAX backend has already started `jax.distributed` (``JaxConfig(use_gpu=True)``
or ``use_tpu=True``) nothing is agreed on: the resolver describes the cluster JAX
joined. On CPU Ray's backend starts nothing, and `initialize_distributed` joins the
cluster from this resolver.

Every attempt of a Ray Train run (after a failure, or an elastic resize) starts new
worker processes, so each joins a fresh JAX cluster of the attempt's size; a job
written with `dt.callbacks.BackupAndRestore` resumes from its last backup on
whatever number of workers the attempt has.

Example (in ``train_loop_per_worker``):
    >>> strategy = dt.MultiWorkerMirroredStrategy()  # doctest: +SKIP
    >>> strategy.cluster_resolver  # doctest: +SKIP
    RayTrainClusterResolver(coordinator_address='10.0.0.5:41234', num_processes=2, ...)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from distrain._src.cluster.base import ENV_LOCAL_DEVICES, ClusterResolver, env_int
from distrain._src.cluster.launch import free_port
from distrain._src.cluster.resolvers import read_device_ids


def _ray_train() -> Any:
    try:
        import ray.train
    except ImportError as e:
        raise ImportError(
            "RayTrainClusterResolver needs Ray Train. Install the extra: "
            f"`pip install 'distrain[ray]'` (Ray with its 'train' dependencies). ({e})"
        ) from e
    return ray.train


class RayTrainClusterResolver(ClusterResolver):
    """The processes of the Ray Train worker group this worker belongs to.

    Create it (or `dt.MultiWorkerMirroredStrategy()`, which finds it through
    `dt.resolve_cluster()`) on every worker of the group, at the start of
    ``train_loop_per_worker``: worker 0 publishes the coordinator address to the
    others, so all of them must take part.

    Args:
        local_device_count: devices each worker must have (on CPU, how many virtual
            devices to create); default ``DISTRAIN_LOCAL_DEVICES``, else whatever it has.
        local_device_ids: local accelerator ids the worker drives; default
            ``DISTRAIN_LOCAL_DEVICE_IDS``, else all it sees.
        environ: where to read those defaults; `os.environ` by default.

    Raises:
        ImportError: Ray Train is not installed.
        RuntimeError: called outside a Ray Train training function.
    """

    def __init__(
        self,
        local_device_count: int | None = None,
        local_device_ids: Sequence[int] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ):
        train = _ray_train()
        env = os.environ if environ is None else environ
        try:
            context = train.get_context()
        except RuntimeError as e:
            raise RuntimeError(
                "RayTrainClusterResolver describes a Ray Train worker group: create it inside "
                "the train_loop_per_worker that JaxTrainer (or another Ray Train trainer) runs, "
                f"on every worker. Received a call from outside one ({e})."
            ) from None
        self._rank = int(context.get_world_rank())
        self._size = int(context.get_world_size())
        self._address = None if self._size == 1 else _agree_on_address(self._rank)
        self._local_device_count = (
            local_device_count
            if local_device_count is not None
            else env_int(env, ENV_LOCAL_DEVICES, minimum=1)
        )
        ids = local_device_ids if local_device_ids is not None else read_device_ids(env)
        self._local_device_ids = None if ids is None else tuple(ids)

    @staticmethod
    def is_present() -> bool:
        """Whether this code runs in a Ray Train training function (without importing Ray)."""
        if "ray.train" not in sys.modules:
            return False
        try:
            sys.modules["ray.train"].get_context()
        except Exception:  # noqa: BLE001 - outside a worker Ray raises; any failure means "no"
            return False
        return True

    @property
    def coordinator_address(self) -> str | None:
        return self._address

    @property
    def num_processes(self) -> int:
        return self._size

    @property
    def process_id(self) -> int:
        return self._rank

    @property
    def task_type(self) -> str:
        return "worker"

    @property
    def task_id(self) -> int:
        return self._rank

    @property
    def local_device_count(self) -> int | None:
        return self._local_device_count

    @property
    def local_device_ids(self) -> tuple[int, ...] | None:
        return self._local_device_ids


def _agree_on_address(rank: int) -> str | None:
    """Worker 0's "ip:port", known to every worker; None if JAX already joined a cluster."""
    import jax

    if jax.distributed.is_initialized():
        return None  # Ray's JAX backend joined it (use_gpu / use_tpu)
    import ray
    from ray.train.collective import broadcast_from_rank_zero

    proposal = None
    if rank == 0:
        # A port free now on every interface: JAX's coordinator binds [::]:port.
        proposal = f"{ray.util.get_node_ip_address()}:{free_port('')}"
    address: str = broadcast_from_rank_zero(proposal)
    return address
