"""Experimental strategies (``dt.experimental``)."""

from distrain.strategy.central_storage import CentralStorageStrategy as CentralStorageStrategy

__all__ = ["CentralStorageStrategy"]
