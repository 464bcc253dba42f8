"""Experimental strategies (``dt.experimental``): central storage and parameter servers.

``MultiWorkerMirroredStrategy`` is also here because TensorFlow 2.x code spells it
``tf.distribute.experimental.MultiWorkerMirroredStrategy``; it is the same class as
``dt.MultiWorkerMirroredStrategy``.
"""

from distrain.experimental import coordinator as coordinator
from distrain.experimental import partitioners as partitioners
from distrain.ps.strategy import ParameterServerStrategy as ParameterServerStrategy
from distrain.strategy.central_storage import CentralStorageStrategy as CentralStorageStrategy
from distrain.strategy.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)

__all__ = [
    "CentralStorageStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "coordinator",
    "partitioners",
]
