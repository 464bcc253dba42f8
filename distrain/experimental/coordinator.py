"""``dt.experimental.coordinator``: scheduling functions on parameter-server workers."""

from distrain._src.ps.cluster_coordinator import ClusterCoordinator as ClusterCoordinator
from distrain._src.ps.errors import FunctionCancelledError as FunctionCancelledError
from distrain._src.ps.errors import OutOfRangeError as OutOfRangeError
from distrain._src.ps.errors import (
    ParameterServerUnavailableError as ParameterServerUnavailableError,
)
from distrain._src.ps.errors import WorkerUnavailableError as WorkerUnavailableError
from distrain._src.ps.per_worker_datasets import PerWorkerDataset as PerWorkerDataset
from distrain._src.ps.per_worker_datasets import PerWorkerIterator as PerWorkerIterator
from distrain._src.ps.scheduled_functions import RemoteValue as RemoteValue

__all__ = [
    "ClusterCoordinator",
    "FunctionCancelledError",
    "OutOfRangeError",
    "ParameterServerUnavailableError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "WorkerUnavailableError",
]
