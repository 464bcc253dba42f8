"""Framework ops a model calls inside a replica (``dt.nn``).

They read the replica's named mesh (``devices_per_replica={"stage": 4, ...}``) and split
their work over their axis; without that axis they are the plain JAX computation.

Example:
  >>> y = dt.nn.pipeline(layer_fn, stacked_params, x, microbatches=8)
"""

from distrain._src.nn.pipeline import pipeline as pipeline

__all__ = [
    "pipeline",
]
