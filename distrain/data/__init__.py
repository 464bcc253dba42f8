"""Input pipelines and distributed datasets."""

from distrain.data.distributed import DistributedDataset as DistributedDataset
from distrain.data.distributed import InputContext as InputContext
from distrain.data.distributed import InputOptions as InputOptions

__all__ = ["DistributedDataset", "InputContext", "InputOptions"]
