"""Experimental strategies (``dt.experimental``): central storage and parameter servers."""

from distrain.experimental import coordinator as coordinator
from distrain.experimental import partitioners as partitioners
from distrain.ps.strategy import ParameterServerStrategy as ParameterServerStrategy
from distrain.strategy.central_storage import CentralStorageStrategy as CentralStorageStrategy

__all__ = ["CentralStorageStrategy", "ParameterServerStrategy", "coordinator", "partitioners"]
