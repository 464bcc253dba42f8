"""``dt.experimental.partitioners``: how large variables split across parameter servers."""

from distrain.ps import FixedShardsPartitioner as FixedShardsPartitioner
from distrain.ps import MaxSizePartitioner as MaxSizePartitioner
from distrain.ps import MinSizePartitioner as MinSizePartitioner
from distrain.ps import Partitioner as Partitioner

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
