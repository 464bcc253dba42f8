"""Input pipelines, datasets and distributed datasets (``dt.data``).

``InputContext`` and ``InputOptions`` are tf.distribute names, so they live on ``dt``
itself (``dt.InputContext``, ``dt.InputOptions``), as in ``tf.distribute``.
"""

from typing import TYPE_CHECKING

from distrain._src import deprecations as _deprecations
from distrain._src.data.datasets import load_digits as load_digits
from distrain._src.data.datasets import load_mnist as load_mnist
from distrain._src.data.distributed import DistributedDataset as DistributedDataset
from distrain._src.data.distributed import DistributedIterator as DistributedIterator
from distrain._src.data.pipeline import ArrayPipeline as ArrayPipeline

if not TYPE_CHECKING:  # dt.data.InputContext / InputOptions: deprecated, see dt.*
    __getattr__ = _deprecations.getattr_hook(__name__)

__all__ = [
    "ArrayPipeline",
    "DistributedDataset",
    "DistributedIterator",
    "load_digits",
    "load_mnist",
]
