"""``MultiWorkerMirroredStrategy``: MirroredStrategy over every device of every process.

Construction joins this process to the cluster (``jax.distributed`` through
``distrain._src.cluster.initialize_distributed``); from then on it is the same strategy
as ``MirroredStrategy``, with a mesh over ``jax.devices()`` (all processes, in
process order) instead of ``jax.local_devices()``. The same ``train_step`` gives the
same numbers; gradients are summed across processes by the same ``psum`` (gloo on
CPU, NCCL on GPU).

What differs between processes:

* input: ``experimental_distribute_dataset`` copies only this process's rows of each
  global batch; ``distribute_datasets_from_function`` calls ``dataset_fn`` on every
  process with ``InputContext(input_pipeline_id=process id, ...)`` so that each reads
  only its own part;
* chief duties: ``strategy.is_chief`` (process 0) is the one that prints progress
  and writes logs and TensorBoard files; every process takes part in checkpoint
  saves (orbax writes each array once and coordinates the processes itself).

Example:
    >>> strategy = dt.MultiWorkerMirroredStrategy()       # reads DISTRAIN_* / TF_CONFIG
    >>> with strategy.scope():
    ...     state = strategy.put_replicated(dt.TrainState.create(params=p, tx=tx))
    >>> if strategy.is_chief:
    ...     print("replicas:", strategy.num_replicas_in_sync)
"""

from __future__ import annotations

from typing import Literal

import jax

from distrain._src.cluster.base import ClusterResolver
from distrain._src.cluster.communication import CommunicationOptions
from distrain._src.cluster.runtime import initialize_distributed
from distrain._src.strategy.base import Strategy
from distrain._src.strategy.replica_mesh import DevicesPerReplica
from distrain._src.strategy.rules import LayoutRules, LogicalAxisRules
from distrain._src.strategy.sharded import DEFAULT_MIN_SHARD_BYTES


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over all devices of all processes.

    Create it first thing in the program: JAX can join a cluster only before it has
    created its devices.

    Args:
      cluster_resolver: who the processes are; default ``dt.resolve_cluster()``:
        DISTRAIN_* variables (``distrain launch``), else ``TF_CONFIG``, else what
        ``jax.distributed`` detects (Slurm, Open MPI, TPU), else a single process.
      communication_options: ``dt.CommunicationOptions(implementation, timeout_seconds)``;
        default from DISTRAIN_COLLECTIVES / DISTRAIN_TIMEOUT_SECONDS, else "auto" with
        a 20 s heartbeat (docs/multi_worker.md, "Timeouts").
      shard_state: keep ``1/N`` of each large state leaf per device (all devices of all
        processes) between steps, as ``MirroredStrategy(shard_state=True)``; or, with
        ``"process"``, split each leaf over the devices of each process and keep one
        copy per process (hybrid sharding, HSDP: with one process per host the
        all-gather stays inside a host).
      min_shard_bytes: with ``shard_state`` or ``devices_per_replica``, leaves below
        this size stay replicated.
      devices_per_replica: the devices of one replica, as in ``MirroredStrategy``
        (an int, or named inner axes such as ``{"fsdp": 8, "tensor": 4}``): part of one
        process or whole processes (a replica may span hosts: FSDP across them);
        ``"process"``: one replica per process, split over its devices (HSDP:
        parameters gathered inside a host, gradients summed across hosts).
      layout: layout rules inside a replica, as in ``MirroredStrategy``.
      logical_axis_rules: logical names of specs, as in ``MirroredStrategy``.
      batch_layout: batch leaves' other dimensions over inner axes, as in
        ``MirroredStrategy``.

    Raises:
      ValueError: the task is a TF_CONFIG "ps"/"evaluator" task, or the collectives
        implementation does not fit the devices.
      TimeoutError: the coordinator could not be reached in time.
      RuntimeError: JAX already started without the cluster, or the processes have
        different numbers of devices.

    Example:
      >>> strategy = dt.MultiWorkerMirroredStrategy(
      ...     communication_options=dt.CommunicationOptions("ring", timeout_seconds=60))
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        shard_state: bool | Literal["process"] = False,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
        devices_per_replica: DevicesPerReplica = 1,
        layout: LayoutRules | None = None,
        logical_axis_rules: LogicalAxisRules | None = None,
        batch_layout: LayoutRules | None = None,
    ) -> None:
        if communication_options is not None and not isinstance(
            communication_options, CommunicationOptions
        ):
            raise TypeError(
                "communication_options must be a dt.CommunicationOptions. Received: "
                f"{type(communication_options).__name__}."
            )
        if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                "cluster_resolver must be a dt.ClusterResolver (e.g. "
                "TFConfigClusterResolver()). Received: "
                f"{type(cluster_resolver).__name__}."
            )
        if communication_options is None:
            communication_options = CommunicationOptions.from_env()
        self._communication_options = communication_options
        self._cluster_resolver = initialize_distributed(cluster_resolver, communication_options)
        # Replicas in process order: each process's replicas are contiguous, so its
        # rows of a global batch are one contiguous slice.
        super().__init__(
            sorted(jax.devices(), key=lambda d: (d.process_index, d.id)),
            devices_per_replica=devices_per_replica,
            layout=layout,
            logical_axis_rules=logical_axis_rules,
            batch_layout=batch_layout,
            min_shard_bytes=min_shard_bytes,
            shard_state=shard_state,
        )

    def state_sharding(self, shape: tuple[int, ...], path: str = "") -> jax.sharding.Sharding:
        return self._placement.state_sharding(shape, path)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver this strategy joined the cluster with."""
        return self._cluster_resolver

    @property
    def num_processes(self) -> int:
        return jax.process_count()

    @property
    def process_id(self) -> int:
        return jax.process_index()

    @property
    def communication_options(self) -> CommunicationOptions:
        """The collectives implementation and timeouts in force."""
        return self._communication_options

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"num_processes={jax.process_count()}, process_id={jax.process_index()})"
        )
