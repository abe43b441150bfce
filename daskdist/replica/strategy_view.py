"""The strategy as a function running on a replica sees it (``ctx.strategy``, a captured strategy)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from daskdist import context, registry
from daskdist.group.service import STRATEGY
from daskdist.ops import CommunicationOptions, ReduceOp
from daskdist.values import gather_values, local_results, reduce_values

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["CLUSTER_RESOLVER_KEY", "ReplicaExtendedView", "ReplicaStrategyView"]

#: The id of the resident (kind ``STRATEGY``) under which multi-worker strategies leave each replica its
#: cluster resolver.
CLUSTER_RESOLVER_KEY = "cluster-resolver"


def _cluster_resolver(service: ReplicaService) -> Any:
    return service.objects.find(STRATEGY, CLUSTER_RESOLVER_KEY)


def _require_cross_replica(api: str) -> None:
    frame = context.current_frame()
    if frame is not None and frame.replica_context is not None:
        raise RuntimeError(
            f"strategy.{api} is for cross-replica context (the client, or inside merge_call); "
            "inside a replica function use dd.get_replica_context().all_reduce / all_gather"
        )


class ReplicaExtendedView:
    """``strategy.extended`` inside a replica: reductions and updates for ``merge_call``."""

    def __init__(self, runtime: ReplicaService):
        self._runtime = runtime

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return tuple(self._runtime.devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(self._runtime.devices)

    @property
    def should_checkpoint(self) -> bool:
        """Under a multi-worker strategy only on global replica 0 (the chief's first); else ``True`` (TF)."""
        return _cluster_resolver(self._runtime) is None or self._runtime.rank == 0

    @property
    def should_save_summary(self) -> bool:
        """As ``should_checkpoint``: one writer in the cluster."""
        return self.should_checkpoint

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None,
                  options: CommunicationOptions | None = None) -> Any:
        """Reduce a ``PerReplica`` value from ``merge_call`` (the values are already on every replica)."""
        _require_cross_replica("extended.reduce_to")
        return reduce_values(reduce_op, value, None, self._runtime.size)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                        options: CommunicationOptions | None = None) -> list[Any]:
        return [self.reduce_to(reduce_op, v, d, options) for v, d in value_destination_pairs]

    def read_var(self, v: Any) -> Any:
        """Inside ``merge_call``: a sync-on-read variable's aggregate, a mirrored variable's value (TF's ``read_var``).

        ``merge_fn`` runs on every replica, so the aggregate is one collective
        that every replica joins (``ONLY_FIRST_REPLICA``: replica 0's copy).
        """
        from daskdist.variables.distributed import (
            _AGGREGATION_OPS,
            DistributedVariable,
            SyncOnReadVariable,
            VariableAggregation,
        )

        _require_cross_replica("extended.read_var")
        if not isinstance(v, DistributedVariable) or v._token != self._runtime.token:
            raise ValueError(f"extended.read_var needs a variable of this strategy, got {type(v).__name__}")
        if not isinstance(v, SyncOnReadVariable):
            return v.read_value()
        comm = self._runtime.process_group
        if v.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return comm.broadcast(v._value, root=0)
        if v.aggregation is VariableAggregation.NONE:
            raise ValueError(f"Cannot read SyncOnReadVariable '{v.name}' in cross-replica context with aggregation NONE")
        return comm.all_reduce(_AGGREGATION_OPS[v.aggregation], v._value)

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` belongs to this strategy (created in its scope or by its replicas)."""
        from daskdist.variables.distributed import DistributedVariable, Variable

        if not isinstance(v, Variable):
            raise TypeError(f"variable_created_in_scope takes a variable, got {type(v).__name__}")
        return isinstance(v, DistributedVariable) and v._token == self._runtime.token

    def update(self, var: Any, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
               group: bool = True) -> Any:
        """Run ``fn(var, *args, **kwargs)`` in cross-replica context: updates apply to this copy as given."""
        frame = context.Frame(strategy=self._runtime.strategy_view, replica_context=None,
                              variable_creator=None, owner=self._runtime)
        with context.enter(frame):
            return fn(var, *args, **(kwargs or {}))


class ReplicaStrategyView:
    """The strategy inside a replica: its size, reductions for ``merge_call``, a no-op ``scope``."""

    def __init__(self, runtime: ReplicaService):
        self._runtime = runtime
        self.extended = ReplicaExtendedView(runtime)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (registry.resolve_strategy, (self._runtime.token,))

    @property
    def num_replicas_in_sync(self) -> int:
        return self._runtime.size

    @property
    def cluster_resolver(self) -> Any:
        """Under MultiWorkerMirroredStrategy, a resolver with task type ``"worker"`` and this host's index; else ``None``."""
        return _cluster_resolver(self._runtime)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        yield self

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, options: Any = None) -> Any:
        """Inside a replica, ``run`` calls ``fn`` on this replica, in replica context.

        From cross-replica context on the replica (a function scheduled on a
        parameter-server worker, as TensorFlow runs it) ``fn`` enters this
        replica's context; in replica context it is just called.
        """
        frame = context.current_frame()
        if frame is None or frame.replica_context is not None:
            return fn(*args, **(kwargs or {}))
        replica = context.Frame(strategy=self, replica_context=self._runtime.context,
                                variable_creator=frame.variable_creator, owner=self._runtime)
        with context.enter(replica):
            return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        _require_cross_replica("reduce")
        return reduce_values(reduce_op, value, axis, self._runtime.size)

    def gather(self, value: Any, axis: int) -> Any:
        _require_cross_replica("gather")
        return gather_values(value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        return local_results(value)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """On a one-replica worker (a parameter-server worker's dataset function), the dataset itself.

        TensorFlow's ``ParameterServerStrategy`` builds a worker's distributed
        dataset for its one replica; batches stay whole. With several
        replicas in sync, datasets are distributed from the client.
        """
        self._require_one_replica("experimental_distribute_dataset")
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any:
        """On a one-replica worker, ``dataset_fn(InputContext())``: one pipeline, one replica in sync (TF's PS worker)."""
        from daskdist.data.options import InputContext

        self._require_one_replica("distribute_datasets_from_function")
        return dataset_fn(InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1))

    def _require_one_replica(self, api: str) -> None:
        if self._runtime.size != 1:
            raise RuntimeError(
                f"strategy.{api} inside a replica of {self._runtime.size} replicas in sync: distribute datasets "
                "on the client (the strategy's own method), and pass them to strategy.run"
            )

    def __repr__(self) -> str:
        return f"<replica {self._runtime.rank} of {self._runtime.size} in {self._runtime.token}>"
