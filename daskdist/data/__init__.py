"""Input pipelines over Dask partitions (``tf.data``-style) and their distribution to replicas."""

from __future__ import annotations

from daskdist.data.dataset import Dataset, TensorSpec
from daskdist.data.distributed import DistributedDataset, DistributedIterator, Optional, OutOfRangeError
from daskdist.data.options import AutoShardPolicy, InputContext, InputOptions
from daskdist.data.plan import Plan

__all__ = [
    "AutoShardPolicy",
    "Dataset",
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "Optional",
    "OutOfRangeError",
    "Plan",
    "TensorSpec",
]
