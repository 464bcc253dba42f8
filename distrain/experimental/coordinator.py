"""``dt.experimental.coordinator``: scheduling functions on parameter-server workers."""

from distrain.ps import ClusterCoordinator as ClusterCoordinator
from distrain.ps import FunctionCancelledError as FunctionCancelledError
from distrain.ps import OutOfRangeError as OutOfRangeError
from distrain.ps import ParameterServerUnavailableError as ParameterServerUnavailableError
from distrain.ps import PerWorkerDataset as PerWorkerDataset
from distrain.ps import PerWorkerIterator as PerWorkerIterator
from distrain.ps import RemoteValue as RemoteValue
from distrain.ps import WorkerUnavailableError as WorkerUnavailableError

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
