"""Experimental strategies (``dt.experimental``): central storage and parameter servers.

``MultiWorkerMirroredStrategy`` is also here because TensorFlow 2.x code spells it
``tf.distribute.experimental.MultiWorkerMirroredStrategy``; it is the same class as
``dt.MultiWorkerMirroredStrategy``.
"""

from distrain._src import lazy as _lazy
from distrain._src.strategy.central_storage import CentralStorageStrategy as CentralStorageStrategy
from distrain._src.strategy.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)

# The parameter-server package (and its backends) loads on first use.
__getattr__, __dir__ = _lazy.exports(
    globals(),
    {
        "ParameterServerStrategy": "distrain._src.ps.strategy:ParameterServerStrategy",
        "coordinator": "distrain.experimental.coordinator",
        "partitioners": "distrain.experimental.partitioners",
    },
)

__all__ = [
    "CentralStorageStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "coordinator",
    "partitioners",
]
