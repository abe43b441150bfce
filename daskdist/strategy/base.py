"""The public ``Strategy`` API (TF's ``tf.distribute.Strategy``), a thin class over an ``Extended``."""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import optree

from daskdist import context, registry
from daskdist.data.replica import BatchRef
from daskdist.ops import ReduceOp
from daskdist.strategy.extended.options import RunOptions, ValueContext
from daskdist.values import DistributedValues, gather_values, local_results, reduce_values, regroup

if TYPE_CHECKING:
    from daskdist.strategy.extended.contract import StrategyExtended

__all__ = ["Strategy"]


class Strategy:
    """A way to run a computation on several replicas (TF's ``tf.distribute.Strategy``).

    Use it as a context manager (``with dd.MirroredStrategy() as strategy:``)
    or call ``close()`` when done: it stops the replicas, and the embedded
    cluster if the strategy started one.
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended

    # -- properties ----------------------------------------------------------------

    @property
    def extended(self) -> StrategyExtended:
        """The implementation object (TF's ``strategy.extended``)."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step in lockstep."""
        return self._extended.num_replicas

    @property
    def cluster_resolver(self) -> Any:
        """``None`` for single-job strategies, as in TensorFlow."""
        return None

    @property
    def client(self) -> Any:
        """The ``distributed.Client`` the strategy uses."""
        return self._extended.client

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard of the cluster the replicas run on."""
        return getattr(self._extended.client, "dashboard_link", None)

    # -- contexts ----------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Cross-replica context: variables created inside are distributed over the replicas."""
        self._extended.check_open()
        self._require_no_other_strategy()
        frame = context.Frame(strategy=self, replica_context=None, variable_creator=self._extended.create_variable)
        with context.enter(frame):
            yield self

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the replicas and free everything they hold on the workers (idempotent)."""
        self._extended.close()

    # -- running -----------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, options: Any = None) -> Any:
        """Run ``fn(*args, **kwargs)`` on every replica; return a ``PerReplica`` structure of results.

        ``PerReplica`` arguments give each replica its own component; other
        arguments go to every replica. Distributed variables captured by ``fn``
        are not shipped: each replica uses its own copy. With one replica the
        result is returned as is. A leaf every replica returned as one object
        (``None``, a bool, a small int, a distributed variable) comes back as
        itself, as TF's regroup does, so ``run(lambda: None)`` is ``None``.
        """
        if not callable(fn):
            raise TypeError(f"strategy.run needs a callable, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(f"options must be a distribute.RunOptions, got {type(options).__name__}")
        self._require_no_other_strategy()
        with context.shipping_to(self) as shipment:
            result = self._extended.call_for_each_replica(fn, tuple(args), dict(kwargs or {}))
        for sent in shipment.sent_in_full:  # every replica installed it: later runs send a reference only
            sent._installed = True
        return result

    def _require_no_other_strategy(self) -> None:
        """Raise as TensorFlow does when another strategy's scope is in effect in this thread."""
        frame = context.current_frame()
        if frame is not None and frame.replica_context is None and frame.strategy is not self:
            raise RuntimeError(
                f"Mixing different tf.distribute.Strategy objects: {context.describe_strategy(frame.strategy)} "
                f"is not {context.describe_strategy(self)}"
            )

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduce ``value`` across replicas, and along ``axis`` if given.

        ``value``: results of ``run``, or an element of a distributed dataset
        (its batches, held by the replicas, are brought to the client first).
        """
        return reduce_values(reduce_op, self._batches_fetched(value), axis, self.num_replicas_in_sync)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the replicas' components of ``value`` along ``axis``."""
        return gather_values(self._batches_fetched(value), axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` as a tuple, one per replica (the arrays of a distributed dataset's element)."""
        return local_results(self._batches_fetched(value))

    def _batches_fetched(self, value: Any) -> Any:
        """``value`` with the replica-held batches of a distributed dataset's element (``BatchRef``) as arrays.

        TensorFlow's element holds the tensors themselves; here each replica
        holds its batch, and one ``run`` brings them to the client.
        """
        leaves = optree.tree_leaves(value, is_leaf=_is_distributed_or_batch, none_is_leaf=True)
        if not any(_holds_batch(leaf) for leaf in leaves):
            return value
        return self.run(_same, args=(value,))

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``value_fn(ValueContext(i, n))`` for each replica ``i``, regrouped: a ``PerReplica`` at each leaf.

        A tuple (or dict, list) returned by ``value_fn`` gives a tuple of
        ``PerReplica``, as TensorFlow's ``regroup(..., always_wrap=True)``.
        """
        n = self.num_replicas_in_sync
        values = [value_fn(ValueContext(i, n)) for i in range(n)]
        return values[0] if n == 1 else regroup(values, always_wrap=True)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Distribute ``dataset`` (batched with the global batch size) over the replicas.

        Each replica reads the partitions that live on its worker (balanced by
        bytes; ``plan()`` shows the map and what must move), batches with its
        share of the global batch, and prefetches. Iterate on the client for
        ``PerReplica`` handles to pass to ``run``, or inside a replica function
        to read the local shard directly.
        """
        return self._extended.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any:
        """Each replica builds its own dataset with ``dataset_fn(InputContext)`` (batched per replica)."""
        return self._extended.distribute_datasets_from_function(dataset_fn, options)

    def step_timings(self, last: int | None = None) -> list[list[dict[str, Any]]]:
        """Per replica, the phase timings of the most recent steps (see ``StepTiming``)."""
        return self._extended.step_timings(last)

    def timeline(self, path: str | os.PathLike[str], last: int | None = None) -> str:
        """Write the replicas' recent steps as a Chrome trace (open in ``chrome://tracing`` or Perfetto).

        Per replica a process; per step its input waits, compute, each
        collective (with its bytes) and variable updates. ``last`` limits the
        steps per replica. Returns ``path``.
        """
        from daskdist.dashboard.timeline import write_chrome_trace

        return write_chrome_trace(path, self.step_timings(last), list(self._extended.worker_addresses))

    # -- pickling and display ----------------------------------------------------------

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (registry.resolve_strategy, (self._extended.token,))

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} replicas={self.num_replicas_in_sync} "
            f"devices={list(self._extended.worker_devices)}>"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r}</td><td>{html.escape(d)}</td><td>{html.escape(a)}</td></tr>"
            for r, (d, a) in enumerate(zip(self._extended.worker_devices, self._extended.worker_addresses))
        )
        link = self.dashboard_link
        dash = f'<p>Dashboard: <a href="{html.escape(link)}" target="_blank">{html.escape(link)}</a></p>' if link else ""
        return (
            f"<div><b>{type(self).__name__}</b> with {self.num_replicas_in_sync} replicas{dash}"
            f"<table><tr><th>replica</th><th>device</th><th>worker</th></tr>{rows}</table></div>"
        )


def _is_distributed_or_batch(x: Any) -> bool:
    return isinstance(x, (DistributedValues, BatchRef))


def _holds_batch(leaf: Any) -> bool:
    if isinstance(leaf, DistributedValues):
        return any(isinstance(component, BatchRef) for component in leaf.values)
    return isinstance(leaf, BatchRef)


def _same(value: Any) -> Any:
    """What a replica returns to hand its batch to the client: the batch itself."""
    return value

