"""``tf.distribute``'s layout: a script written for ``tf.distribute`` runs with ``from daskdist import distribute``.

Every name here is daskdist's own implementation (the same objects as the
top-level ``daskdist.*`` names); this package only arranges them as
TensorFlow does, with ``distribute.experimental`` for the experimental
namespace. Strategies and submodules other issues add (``MultiWorkerMirroredStrategy``,
``cluster_resolver``, ``coordinator``) are one import line each here.

Examples
--------
>>> from daskdist import distribute                          # doctest: +SKIP
>>> strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
>>> strategy.run(lambda: distribute.get_replica_context().replica_id_in_sync_group)
"""

from __future__ import annotations

from daskdist import cluster_resolver
from daskdist.context import (
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from daskdist.cross_device_ops import CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce, ReductionToOneDevice
from daskdist.data.distributed import DistributedDataset, DistributedIterator
from daskdist.data.options import InputContext, InputOptions
from daskdist.distribute import experimental
from daskdist.experimental import coordinator
from daskdist.ops import ReduceOp
from daskdist.replica.context import ReplicaContext
from daskdist.strategy.base import Strategy
from daskdist.strategy.extended.contract import StrategyExtended
from daskdist.strategy.extended.options import RunOptions
from daskdist.strategy.mirrored import MirroredStrategy
from daskdist.strategy.multi_worker_mirrored import MultiWorkerMirroredStrategy
from daskdist.strategy.one_device import OneDeviceStrategy
from daskdist.strategy.parameter_server import ParameterServerStrategy
from daskdist.values import DistributedValues

__all__ = [
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "cluster_resolver",
    "coordinator",
    "experimental",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
