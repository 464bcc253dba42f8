"""distrain: tf.distribute-style distributed training with custom loops, native to JAX.

Example:
  >>> import distrain as dt
  >>> strategy = dt.MirroredStrategy()
  >>> with strategy.scope():
  ...     state = strategy.put_replicated(dt.TrainState.create(params=p, tx=optax.adam(1e-3)))
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING

from distrain import metrics as metrics
from distrain import mixed_precision as mixed_precision
from distrain._src import lazy as _lazy
from distrain._src.cluster.base import ClusterResolver as ClusterResolver
from distrain._src.cluster.communication import (
    CommunicationImplementation as CommunicationImplementation,
)
from distrain._src.cluster.communication import CommunicationOptions as CommunicationOptions
from distrain._src.cluster.kubernetes import KubernetesClusterResolver as KubernetesClusterResolver
from distrain._src.cluster.ray_train import RayTrainClusterResolver as RayTrainClusterResolver
from distrain._src.cluster.resolve import resolve_cluster as resolve_cluster
from distrain._src.cluster.resolvers import AutoClusterResolver as AutoClusterResolver
from distrain._src.cluster.resolvers import EnvClusterResolver as EnvClusterResolver
from distrain._src.cluster.resolvers import SimpleClusterResolver as SimpleClusterResolver
from distrain._src.cluster.runtime import initialize_distributed as initialize_distributed
from distrain._src.cluster.tf_config import TFConfigClusterResolver as TFConfigClusterResolver
from distrain._src.cluster.tpu_resolver import TPUClusterResolver as TPUClusterResolver
from distrain._src.cluster.tpu_system import initialize_tpu_system as initialize_tpu_system
from distrain._src.context import ReduceOp as ReduceOp
from distrain._src.context import ReplicaContext as ReplicaContext
from distrain._src.context import get_replica_context as get_replica_context
from distrain._src.context import has_strategy as has_strategy
from distrain._src.context import in_cross_replica_context as in_cross_replica_context
from distrain._src.cross_device_ops import AllReduce as AllReduce
from distrain._src.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from distrain._src.cross_device_ops import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
from distrain._src.cross_device_ops import NcclAllReduce as NcclAllReduce
from distrain._src.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from distrain._src.current import get_strategy as get_strategy
from distrain._src.losses import compute_average_loss as compute_average_loss
from distrain._src.losses import scale_regularization_loss as scale_regularization_loss
from distrain._src.strategy.base import Strategy as Strategy
from distrain._src.strategy.mirrored import MirroredStrategy as MirroredStrategy
from distrain._src.strategy.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from distrain._src.strategy.one_device import OneDeviceStrategy as OneDeviceStrategy
from distrain._src.strategy.replica_layout import ReplicaLayout as ReplicaLayout
from distrain._src.strategy.rules import OrderedAxisRules as OrderedAxisRules
from distrain._src.strategy.tpu_strategy import TPUStrategy as TPUStrategy
from distrain._src.train.accumulation import accumulate_gradients as accumulate_gradients
from distrain._src.train.history import History as History
from distrain._src.train.state import TrainState as TrainState
from distrain._src.train.trainer import DataEndedError as DataEndedError
from distrain._src.train.trainer import Trainer as Trainer
from distrain._src.values import PerReplica as PerReplica

# Heavy dependencies (orbax, grain, tensorboardX, pydantic, the parameter-server
# backends) load on first use of these names (distrain/_src/lazy.py). Type checkers
# read the same names from the block below (as jax/scipy/__init__.py does), and
# tests/test_public_api.py checks that the two agree.
_LAZY = {
    "callbacks": "distrain.callbacks",
    "checkpoint": "distrain.checkpoint",
    "config": "distrain.config",
    "data": "distrain.data",
    "experimental": "distrain.experimental",
    "goodput": "distrain.goodput",
    "models": "distrain.models",
    "nn": "distrain.nn",
    "InputContext": "distrain._src.data.options:InputContext",
    "InputOptions": "distrain._src.data.options:InputOptions",
    "SidecarEvaluator": "distrain._src.train.sidecar:SidecarEvaluator",
}
if TYPE_CHECKING:
    from distrain import callbacks as callbacks
    from distrain import checkpoint as checkpoint
    from distrain import config as config
    from distrain import data as data
    from distrain import experimental as experimental
    from distrain import goodput as goodput
    from distrain import models as models
    from distrain import nn as nn
    from distrain._src.data.options import InputContext as InputContext
    from distrain._src.data.options import InputOptions as InputOptions
    from distrain._src.train.sidecar import SidecarEvaluator as SidecarEvaluator
else:
    __getattr__, __dir__ = _lazy.exports(globals(), _LAZY)

__all__ = [
    "AllReduce",
    "AutoClusterResolver",
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
    "KubernetesClusterResolver",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "OrderedAxisRules",
    "PerReplica",
    "RayTrainClusterResolver",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "ReplicaLayout",
    "SidecarEvaluator",
    "SimpleClusterResolver",
    "Strategy",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TPUStrategy",
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
    "goodput",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_distributed",
    "initialize_tpu_system",
    "metrics",
    "mixed_precision",
    "models",
    "nn",
    "resolve_cluster",
    "scale_regularization_loss",
]

from distrain._src.goodput.ledger import milestone as _milestone  # noqa: E402

_milestone("imported")  # jax and distrain: the goodput report's start-up breakdown
