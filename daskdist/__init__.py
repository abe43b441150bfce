"""daskdist: TensorFlow's ``tf.distribute`` strategies, served by a Dask cluster."""

from __future__ import annotations

from daskdist import cluster_resolver, compat, data, distribute, elastic, experimental, nn, plugins, train
from daskdist import config as _config  # noqa: F401  (registers daskdist.* defaults in dask.config)
from daskdist.context import get_replica_context, get_strategy, has_strategy, in_cross_replica_context
from daskdist.cross_device_ops import (
    AllReduceCrossDeviceOps,
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from daskdist.data import InputContext, InputOptions, OutOfRangeError
from daskdist.elastic import ElasticOptions
from daskdist.exceptions import (
    CheckpointError,
    ClientClosedError,
    CollectiveAbortedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DaskdistError,
    ElasticRecoveryError,
    ParameterServerLostError,
    RendezvousError,
    ReplicaLostError,
    StaleGenerationError,
    StrategyClosedError,
)
from daskdist.ops import CommunicationImplementation, CommunicationOptions, ReduceOp
from daskdist.replica.context import ReplicaContext
from daskdist.strategy.base import Strategy
from daskdist.strategy.extended import default as _default  # noqa: F401  (installs the default strategy daskdist.context falls back to)
from daskdist.strategy.extended.options import ValueContext
from daskdist.strategy.mirrored import MirroredStrategy
from daskdist.strategy.multi_worker_mirrored import MultiWorkerMirroredStrategy
from daskdist.strategy.one_device import OneDeviceStrategy
from daskdist.strategy.parameter_server import ParameterServerStrategy
from daskdist.values import DistributedValues, Mirrored, PerReplica
from daskdist.variables.distributed import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)
from daskdist.variables.sharded import IndexedSlices

__version__ = "0.1.0"

__all__ = [
    "AllReduceCrossDeviceOps",
    "CheckpointError",
    "ClientClosedError",
    "CollectiveAbortedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DaskdistError",
    "DistributedValues",
    "ElasticOptions",
    "ElasticRecoveryError",
    "GradientTape",
    "HierarchicalCopyAllReduce",
    "IndexedSlices",
    "InputContext",
    "InputOptions",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "OutOfRangeError",
    "ParameterServerLostError",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "RendezvousError",
    "ReplicaContext",
    "ReplicaLostError",
    "StaleGenerationError",
    "Strategy",
    "StrategyClosedError",
    "SyncOnReadVariable",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "cluster_resolver",
    "compat",
    "data",
    "distribute",
    "elastic",
    "experimental",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "nn",
    "plugins",
    "train",
]


def __getattr__(name: str) -> object:
    """``dd.GradientTape`` is ``daskdist.keras.GradientTape``, imported on first use (keras is optional here)."""
    if name == "GradientTape":
        from daskdist.keras.gradient_tape import GradientTape

        return GradientTape
    raise AttributeError(f"module 'daskdist' has no attribute {name!r}")
