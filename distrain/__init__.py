"""distrain: tf.distribute-style distributed training with custom loops, native to JAX.

Example:
  >>> import distrain as dt
  >>> strategy = dt.MirroredStrategy()
  >>> with strategy.scope():
  ...     state = strategy.put_replicated(dt.TrainState.create(params=p, tx=optax.adam(1e-3)))
"""

__version__ = "0.1.0"

from distrain import _lazy
from distrain import metrics as metrics
from distrain import mixed_precision as mixed_precision
from distrain.cluster import AutoClusterResolver as AutoClusterResolver
from distrain.cluster import ClusterResolver as ClusterResolver
from distrain.cluster import CommunicationImplementation as CommunicationImplementation
from distrain.cluster import CommunicationOptions as CommunicationOptions
from distrain.cluster import EnvClusterResolver as EnvClusterResolver
from distrain.cluster import SimpleClusterResolver as SimpleClusterResolver
from distrain.cluster import TFConfigClusterResolver as TFConfigClusterResolver
from distrain.cluster import initialize_distributed as initialize_distributed
from distrain.cluster import resolve_cluster as resolve_cluster
from distrain.context import ReduceOp as ReduceOp
from distrain.context import ReplicaContext as ReplicaContext
from distrain.context import get_replica_context as get_replica_context
from distrain.context import get_strategy as get_strategy
from distrain.context import has_strategy as has_strategy
from distrain.context import in_cross_replica_context as in_cross_replica_context
from distrain.cross_device_ops import AllReduce as AllReduce
from distrain.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from distrain.cross_device_ops import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
from distrain.cross_device_ops import NcclAllReduce as NcclAllReduce
from distrain.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from distrain.losses import compute_average_loss as compute_average_loss
from distrain.losses import scale_regularization_loss as scale_regularization_loss
from distrain.strategy.base import Strategy as Strategy
from distrain.strategy.mirrored import MirroredStrategy as MirroredStrategy
from distrain.strategy.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from distrain.strategy.one_device import OneDeviceStrategy as OneDeviceStrategy
from distrain.train.accumulation import accumulate_gradients as accumulate_gradients
from distrain.train.history import History as History
from distrain.train.state import TrainState as TrainState
from distrain.train.trainer import DataEndedError as DataEndedError
from distrain.train.trainer import Trainer as Trainer
from distrain.values import PerReplica as PerReplica

# Heavy dependencies (orbax, grain, tensorboardX, the parameter-server backends) load
# on first use of these names (distrain/_lazy.py).
_LAZY = {
    "checkpoint": "distrain.checkpoint",
    "data": "distrain.data",
    "experimental": "distrain.experimental",
    "PREEMPTION_EXIT_CODE": "distrain.checkpoint.preemption:PREEMPTION_EXIT_CODE",
    "CheckpointCorruptionError": "distrain.checkpoint._layout:CheckpointCorruptionError",
    "CheckpointManager": "distrain.checkpoint.manager:CheckpointManager",
    "PreemptionHandler": "distrain.checkpoint.preemption:PreemptionHandler",
    "Restored": "distrain.checkpoint.manager:Restored",
    "InputContext": "distrain.data.distributed:InputContext",
    "InputOptions": "distrain.data.distributed:InputOptions",
    "callbacks": "distrain.callbacks",
    "config": "distrain.config",
}
__getattr__, __dir__ = _lazy.exports(globals(), _LAZY)

__all__ = [
    "AllReduce",
    "AutoClusterResolver",
    "CheckpointCorruptionError",
    "CheckpointManager",
    "ClusterResolver",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DataEndedError",
    "EnvClusterResolver",
    "HierarchicalCopyAllReduce",
    "History",
    "InputContext",
    "InputOptions",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PREEMPTION_EXIT_CODE",
    "PerReplica",
    "PreemptionHandler",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Restored",
    "SimpleClusterResolver",
    "Strategy",
    "TFConfigClusterResolver",
    "TrainState",
    "Trainer",
    "accumulate_gradients",
    "callbacks",
    "checkpoint",
    "config",
    "compute_average_loss",
    "data",
    "experimental",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_distributed",
    "metrics",
    "mixed_precision",
    "resolve_cluster",
    "scale_regularization_loss",
]
