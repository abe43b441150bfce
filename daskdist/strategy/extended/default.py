"""The default strategy and replica context in effect outside any strategy (one replica, local).

Importing this module installs them in ``daskdist.context``
(``context.install_defaults``), which sits below the strategies and never
imports them; ``daskdist/__init__`` imports it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from daskdist import context
from daskdist.ops import CommunicationOptions, ReduceOp
from daskdist.values import gather_values, local_results, reduce_values

__all__ = ["OneReplicaContext", "default_replica_context", "default_strategy"]


class _DefaultStrategy:
    """Runs functions directly in this thread, as one replica (TF's default strategy)."""

    num_replicas_in_sync = 1
    cluster_resolver = None
    #: ``context.has_strategy()`` is ``False`` while only this strategy is in effect (inside the default
    #: replica context's ``merge_call``), as in TensorFlow.
    is_default_strategy = True

    @property
    def extended(self) -> _DefaultStrategy:
        return self

    @contextlib.contextmanager
    def scope(self) -> Iterator[_DefaultStrategy]:
        yield self

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, options: Any = None) -> Any:
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        if axis is None:
            ReduceOp.from_any(reduce_op)
            return value
        return reduce_values(reduce_op, value, axis, 1)

    def gather(self, value: Any, axis: int) -> Any:
        return gather_values(value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        return local_results(value)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """``value_fn(ValueContext())``: one replica, so the value itself (as TensorFlow's default strategy)."""
        from daskdist.strategy.extended.options import ValueContext

        return value_fn(ValueContext())

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """The dataset itself: one local replica reads all of it (as TensorFlow's default strategy)."""
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any:
        """``dataset_fn(InputContext())``: one input pipeline, one replica."""
        from daskdist.data.options import InputContext

        return dataset_fn(InputContext())

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None) -> Any:
        """``value`` itself: one replica (TF's ``_DefaultDistributionExtended._reduce_to``); ``reduce_op`` is checked."""
        ReduceOp.from_any(reduce_op)
        return value

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Any, options: Any = None) -> list[Any]:
        """``reduce_to`` of each ``(value, destinations)`` pair: the values themselves, in order."""
        ReduceOp.from_any(reduce_op)
        return [self.reduce_to(reduce_op, value, destinations, options) for value, destinations in value_destination_pairs]

    def update(self, var: Any, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
               group: bool = True) -> Any:
        return fn(var, *args, **(kwargs or {}))

    def __repr__(self) -> str:
        return "<default strategy (one local replica)>"


class OneReplicaContext:
    """One replica in this thread: collectives return their input.

    Outside any strategy it is TF's default replica context (of the default
    strategy); a strategy that runs a function on the client as its one
    replica (``ParameterServerStrategy.run`` on the coordinator) passes
    itself as ``strategy``.
    """

    replica_id_in_sync_group = 0
    num_replicas_in_sync = 1
    devices = ("/job:localhost/replica:0/task:0/device:CPU:0",)

    def __init__(self, strategy: Any = None):
        self._strategy = strategy

    @property
    def strategy(self) -> Any:
        return self._strategy if self._strategy is not None else default_strategy()

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None) -> Any:
        ReduceOp.from_any(reduce_op)
        return value

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        return value

    def broadcast(self, value: Any, root: int = 0, options: CommunicationOptions | None = None) -> Any:
        return value

    def reduce_scatter(self, reduce_op: ReduceOp | str, value: Any, axis: int = 0,
                       options: CommunicationOptions | None = None) -> Any:
        ReduceOp.from_any(reduce_op)
        return value

    def barrier(self, options: CommunicationOptions | None = None) -> None:
        return None

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """``merge_fn(strategy, *args, **kwargs)`` in cross-replica context (TF's default replica context).

        Inside ``merge_fn`` there is no replica context (``get_replica_context()``
        is ``None``, ``in_cross_replica_context()`` is ``True``); outside any
        strategy, the strategy is the default one and ``has_strategy()`` stays
        ``False``.
        """
        strategy = self.strategy
        with context.enter(context.Frame(strategy=strategy, replica_context=None, variable_creator=None)):
            return merge_fn(strategy, *args, **(kwargs or {}))


@functools.cache
def default_strategy() -> _DefaultStrategy:
    return _DefaultStrategy()


@functools.cache
def default_replica_context() -> OneReplicaContext:
    return OneReplicaContext()


context.install_defaults(default_strategy, default_replica_context)
