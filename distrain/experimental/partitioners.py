"""``dt.experimental.partitioners``: how large variables split across parameter servers."""

from distrain._src.ps.partitioners import FixedShardsPartitioner as FixedShardsPartitioner
from distrain._src.ps.partitioners import MaxSizePartitioner as MaxSizePartitioner
from distrain._src.ps.partitioners import MinSizePartitioner as MinSizePartitioner
from distrain._src.ps.partitioners import Partitioner as Partitioner

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
