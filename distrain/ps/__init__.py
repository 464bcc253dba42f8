"""Asynchronous parameter-server training (``dt.experimental.ParameterServerStrategy``).

Modules, one concept each: ``strategy`` (the strategy and its variables),
``coordinator`` (scheduling, failures, checkpoints), ``step`` (the compiled
worker step), ``worker`` (host callbacks and the worker loop), ``server`` (one
parameter server), ``servers`` (all of them as one client), ``layout`` and
``partitioners`` (where variables live), ``datasets`` (per-worker inputs),
``inprocess`` / ``ray_backend`` (the two backends), ``checkpointing``.
"""

from distrain.ps.coordinator import ClusterCoordinator as ClusterCoordinator
from distrain.ps.coordinator import RemoteValue as RemoteValue
from distrain.ps.datasets import PerWorkerDataset as PerWorkerDataset
from distrain.ps.datasets import PerWorkerIterator as PerWorkerIterator
from distrain.ps.errors import FunctionCancelledError as FunctionCancelledError
from distrain.ps.errors import OutOfRangeError as OutOfRangeError
from distrain.ps.errors import ParameterServerUnavailableError as ParameterServerUnavailableError
from distrain.ps.errors import WorkerUnavailableError as WorkerUnavailableError
from distrain.ps.partitioners import FixedShardsPartitioner as FixedShardsPartitioner
from distrain.ps.partitioners import MaxSizePartitioner as MaxSizePartitioner
from distrain.ps.partitioners import MinSizePartitioner as MinSizePartitioner
from distrain.ps.partitioners import Partitioner as Partitioner
from distrain.ps.step import WorkerStep as WorkerStep
from distrain.ps.strategy import ParameterServerStrategy as ParameterServerStrategy
from distrain.ps.strategy import ShardedVariables as ShardedVariables

__all__ = [
    "ClusterCoordinator",
    "FixedShardsPartitioner",
    "FunctionCancelledError",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "OutOfRangeError",
    "ParameterServerStrategy",
    "ParameterServerUnavailableError",
    "Partitioner",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "ShardedVariables",
    "WorkerStep",
    "WorkerUnavailableError",
]
