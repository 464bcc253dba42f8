"""Experimental strategies (``dt.experimental``): central storage, parameter servers,
DiLoCo's islands, and fault-isolated islands (``dt.experimental.islands``).

``MultiWorkerMirroredStrategy`` is ``dt.MultiWorkerMirroredStrategy`` (TensorFlow 2.x
also spells it ``tf.distribute.experimental.MultiWorkerMirroredStrategy``; distrain
has one public path per name).
"""

from typing import TYPE_CHECKING

from distrain._src import lazy as _lazy
from distrain._src.islands.diloco_strategy import DiLoCoStrategy as DiLoCoStrategy
from distrain._src.islands.outer import DiLoCoState as DiLoCoState
from distrain._src.strategy.central_storage import CentralStorageStrategy as CentralStorageStrategy

# The parameter-server package (and its backends) loads on first use; type checkers
# read the same names from the block below (tests/test_public_api.py checks both agree).
_LAZY = {
    "ParameterServerStrategy": "distrain._src.ps.ps_strategy:ParameterServerStrategy",
    "coordinator": "distrain.experimental.coordinator",
    "islands": "distrain.experimental.islands",
    "partitioners": "distrain.experimental.partitioners",
}
if TYPE_CHECKING:
    from distrain._src.ps.ps_strategy import ParameterServerStrategy as ParameterServerStrategy
    from distrain.experimental import coordinator as coordinator
    from distrain.experimental import islands as islands
    from distrain.experimental import partitioners as partitioners
else:
    __getattr__, __dir__ = _lazy.exports(globals(), _LAZY)

__all__ = [
    "CentralStorageStrategy",
    "DiLoCoState",
    "DiLoCoStrategy",
    "ParameterServerStrategy",
    "coordinator",
    "islands",
    "partitioners",
]
