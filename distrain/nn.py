"""Framework ops a model calls inside a replica (``dt.nn``).

They read the replica's named mesh (``devices_per_replica={"context": 4, ...}``,
``{"stage": 4, ...}``) and split their work over their axis; without that axis they are
the plain JAX computation.

Example:
  >>> y = dt.nn.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg)
  >>> batch = dt.nn.load_balance(batch, axis_size=4)     # in the input path
  >>> h = dt.nn.pipeline(layer_fn, stacked_params, x, microbatches=8)
  >>> y, stats = dt.nn.moe(x, moe_params, top_k=2)             # experts over "expert"
"""

from distrain._src.nn.attention import dot_product_attention as dot_product_attention
from distrain._src.nn.load_balance import LoadBalance as LoadBalance
from distrain._src.nn.load_balance import load_balance as load_balance
from distrain._src.nn.load_balance import load_balance_inverse as load_balance_inverse
from distrain._src.nn.load_balance import load_balance_order as load_balance_order
from distrain._src.nn.moe import moe as moe
from distrain._src.nn.moe import route as route
from distrain._src.nn.moe import update_selection_bias as update_selection_bias
from distrain._src.nn.pipeline_stages import pipeline as pipeline

__all__ = [
    "LoadBalance",
    "dot_product_attention",
    "load_balance",
    "load_balance_inverse",
    "load_balance_order",
    "moe",
    "pipeline",
    "route",
    "update_selection_bias",
]
