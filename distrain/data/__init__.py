"""Input pipelines, datasets and distributed datasets (``dt.data``)."""

from distrain.data.datasets import load_digits as load_digits
from distrain.data.datasets import load_mnist as load_mnist
from distrain.data.distributed import DistributedDataset as DistributedDataset
from distrain.data.distributed import DistributedIterator as DistributedIterator
from distrain.data.distributed import InputContext as InputContext
from distrain.data.distributed import InputOptions as InputOptions
from distrain.data.pipeline import ArrayPipeline as ArrayPipeline

__all__ = [
    "ArrayPipeline",
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "load_digits",
    "load_mnist",
]
