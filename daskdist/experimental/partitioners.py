"""``dd.experimental.partitioners``: TF's ``tf.distribute.experimental.partitioners``."""

from __future__ import annotations

from daskdist.variables.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
