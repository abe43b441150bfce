"""``dd.experimental``: TensorFlow's ``tf.distribute.experimental`` names."""

from __future__ import annotations

from daskdist.data.dataset_creator import DatasetCreator
from daskdist.experimental import coordinator, partitioners
from daskdist.strategy.central_storage import CentralStorageStrategy
from daskdist.strategy.parameter_server import ParameterServerStrategy
from daskdist.variables.sharded import ShardedVariable

__all__ = ["CentralStorageStrategy", "DatasetCreator", "ParameterServerStrategy", "ShardedVariable", "coordinator",
           "partitioners"]
