"""Distributed datasets on the client: plan, placement of partitions, iterators of ``PerReplica`` handles."""

from __future__ import annotations

import itertools
import logging
import uuid
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import optree

from daskdist.data import replica as replica_side
from daskdist.data.dataset import Dataset
from daskdist.data.options import AutoShardPolicy, InputContext, InputOptions
from daskdist.data.plan import Plan, PlannedPartition, assign_partitions
from daskdist.data.sources import DaskSource, Partition
from daskdist.exceptions import DaskdistError
from daskdist.values import PerReplica

if TYPE_CHECKING:
    from daskdist.strategy.extended import StrategyExtended

__all__ = ["DistributedDataset", "DistributedIterator", "OutOfRangeError", "Optional"]

logger = logging.getLogger(__name__)


class OutOfRangeError(DaskdistError, StopIteration):
    """``get_next`` was called after the end of the data (TF's ``tf.errors.OutOfRangeError``)."""


class Optional:
    """TF's ``tf.experimental.Optional``: a value or nothing."""

    def __init__(self, value: Any = None, has_value: bool = False):
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        return self._has_value

    def get_value(self) -> Any:
        if not self._has_value:
            raise ValueError("the Optional has no value")
        return self._value


def _identity(x: Any) -> Any:
    return x


def _per_replica_batches(global_batch: int, n: int) -> list[int]:
    return [global_batch // n + (1 if r < global_batch % n else 0) for r in range(n)]


class DistributedDataset:
    """A dataset whose partitions are read by the replicas, where they live.

    Iterating on the client yields ``PerReplica`` handles (the arrays stay on
    the replicas); passed to ``strategy.run`` each resolves to that replica's
    batch. Captured by a function that runs on the replicas, it iterates the
    replica's own shard.
    """

    def __init__(self, extended: StrategyExtended, dataset_id: str, plan: Plan | None, element_spec: Any,
                 futures: list[Any] | None = None):
        self._extended = extended
        self._id = dataset_id
        self._plan = plan
        self._element_spec = element_spec
        self._futures = futures or []  # keep the placed partitions alive on their workers
        self._iterators = itertools.count(1)

    # -- building -------------------------------------------------------------------

    @classmethod
    def from_dataset(cls, extended: StrategyExtended, dataset: Any, options: InputOptions | None) -> DistributedDataset:
        options = options or InputOptions()
        if not isinstance(dataset, Dataset):
            raise TypeError(
                "experimental_distribute_dataset takes a daskdist.data.Dataset; build one with "
                "dd.data.Dataset.from_dask(...), .from_tensor_slices(...) or .range(...) "
                f"(got {type(dataset).__module__}.{type(dataset).__name__})"
            )
        n = extended.num_replicas
        global_batch = dataset.global_batch_size
        if global_batch is None:
            raise ValueError("batch the dataset with the global batch size before distributing it: dataset.batch(B)")
        if global_batch < n:
            raise ValueError(
                f"the global batch size {global_batch} is smaller than the number of replicas {n}; "
                f"use at least {n} (one example per replica)"
            )
        source = dataset.source
        total = source.total_rows
        if total is not None and total < n:
            raise ValueError(f"the dataset has {total} elements, fewer than the {n} replicas")
        batches = _per_replica_batches(global_batch, n)
        element_spec = dataset.element_spec_with(extended.client)
        spec = optree.tree_map(lambda s: (s.shape, np.dtype(s.dtype)), element_spec)
        partitions = source.partitions
        policy = options.auto_shard_policy
        notes = []
        if policy is AutoShardPolicy.AUTO:
            policy = AutoShardPolicy.FILE if len(partitions) >= n else AutoShardPolicy.DATA
            if policy is AutoShardPolicy.DATA:
                notes.append(f"{len(partitions)} partitions < {n} replicas: AUTO fell back to DATA sharding")
        if policy is AutoShardPolicy.FILE and len(partitions) < n:
            raise ValueError(
                f"FILE sharding needs at least as many partitions as replicas ({len(partitions)} < {n}); "
                "repartition the data or use AutoShardPolicy.DATA / AUTO"
            )
        workers = list(extended.worker_addresses)
        futures: list[Any] = []
        if policy is AutoShardPolicy.FILE:
            if isinstance(source, DaskSource):
                local, sizes = _local_bytes(extended, source)
            else:
                local, sizes = [{} for _ in partitions], [p.nbytes for p in partitions]
            replica_of, moved = assign_partitions(sizes, local, workers)
            shares = [[p for p, r in zip(partitions, replica_of) if r == rank] for rank in range(n)]
        else:
            replica_of = [0] * len(partitions)
            moved = [0] * len(partitions)
            shares = [list(partitions) for _ in range(n)]
            sizes = [p.nbytes for p in partitions]
        planned = [
            PlannedPartition(p.index, replica_of[i], workers[replica_of[i]], sizes[i], p.rows, moved[i])
            for i, p in enumerate(partitions)
        ]
        plan = Plan(planned, workers, batches, policy.name, notes)
        if isinstance(source, DaskSource):
            shares, futures = _place_dask_partitions(extended, source, shares, workers)
        dataset_id = uuid.uuid4().hex[:12]
        steps = _known_steps(dataset, plan, policy)
        shards = []
        for rank in range(n):
            shard_source = source
            if isinstance(source, DaskSource):
                shard_source = replica_side.KeyedSource(source.treedef, shares[rank], source.assemble)
            shard_dataset = Dataset(shard_source, dataset.transformations).with_batch_size(batches[rank])
            row_filter = (n, rank) if policy is AutoShardPolicy.DATA else None
            shards.append((dataset_id, replica_side.ReplicaShard(
                shard_dataset, shares[rank], row_filter, spec, options.experimental_per_replica_buffer_size,
                options.experimental_fetch_to_device, steps,
            )))
        extended.run_on_replicas(replica_side.register_shard, args_per_replica=shards)
        distributed = cls(extended, dataset_id, plan, element_spec, futures)
        extended.register_distributed_dataset(dataset_id, distributed)
        logger.debug("%r", plan)
        return distributed

    @classmethod
    def from_function(cls, extended: StrategyExtended, dataset_fn: Callable[[InputContext], Any],
                      options: InputOptions | None) -> DistributedDataset:
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        options = options or InputOptions()
        dataset_id = uuid.uuid4().hex[:12]
        extended.run_on_replicas(replica_side.register_from_function,
                                 (dataset_id, dataset_fn, options.experimental_per_replica_buffer_size))
        distributed = cls(extended, dataset_id, None, None)
        extended.register_distributed_dataset(dataset_id, distributed)
        return distributed

    # -- use -------------------------------------------------------------------------

    def plan(self) -> Plan:
        """The partition -> replica map, the bytes that must move and the steps of each replica."""
        if self._plan is None:
            raise ValueError("datasets from distribute_datasets_from_function have no plan: each replica builds its own")
        return self._plan

    @property
    def element_spec(self) -> Any:
        return self._element_spec

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._extended, self._id, f"{self._id}-{next(self._iterators)}", self._element_spec)

    def __reduce__(self):
        return (replica_side.resolve_dataset, (self._extended.token, self._id))

    def _repr_html_(self) -> str:
        return self._plan._repr_html_() if self._plan is not None else "<b>DistributedDataset</b> (from a function)"


class DistributedIterator:
    """Steps through a distributed dataset; each element is a ``PerReplica`` of replica-held batches.

    Every replica stops at the same step: the iteration ends when all
    replicas are out of data; before that, a replica that ran out gets an
    empty batch (TF's partial-batch behaviour).
    """

    def __init__(self, extended: StrategyExtended, dataset_id: str, iterator_id: str, element_spec: Any):
        self._extended = extended
        self._iterator_id = iterator_id
        self._element_spec = element_spec
        self._steps = itertools.count()
        self._done = False
        extended.run_on_replicas(replica_side.make_iterator, (dataset_id, iterator_id))

    @property
    def element_spec(self) -> Any:
        return self._element_spec

    def get_next(self) -> Any:
        if self._done:
            raise OutOfRangeError("End of sequence")
        step = next(self._steps)
        rows = self._extended.run_on_replicas(replica_side.next_batch, (self._iterator_id, step))
        if all(r < 0 for r in rows):
            self._done = True
            self._close(keep_batches=True)  # the last batches handed out stay usable
            raise OutOfRangeError("End of sequence")
        token = self._extended.token
        refs = [replica_side.BatchRef(token, self._iterator_id, step, r) for r in rows]
        return refs[0] if len(refs) == 1 else PerReplica(refs)

    def get_next_as_optional(self) -> Optional:
        try:
            return Optional(self.get_next(), True)
        except OutOfRangeError:
            return Optional()

    def __next__(self) -> Any:
        try:
            return self.get_next()
        except OutOfRangeError:
            raise StopIteration from None

    def __iter__(self) -> DistributedIterator:
        return self

    def close(self) -> None:
        """Stop the replicas' pipelines and drop the batches this iterator holds there."""
        self._close(keep_batches=False)

    def _close(self, keep_batches: bool) -> None:
        try:
            self._extended.run_on_replicas(replica_side.close_iterator, (self._iterator_id, keep_batches))
        except Exception as e:  # the strategy may be closed already
            logger.debug("Closing iterator %s: %s", self._iterator_id, e)


def _known_steps(dataset: Dataset, plan: Plan, policy: AutoShardPolicy) -> int | None:
    """Batches per pass that every replica runs, if the pipeline keeps row counts (else ``None``)."""
    from daskdist.data import ops

    counting = (ops.Map, ops.Shuffle, ops.Cache, ops.Prefetch)
    after_batch = False
    for op in dataset.transformations:
        if isinstance(op, ops.Batch):
            if after_batch or op.drop_remainder:
                return None
            after_batch = True
        elif not isinstance(op, counting):
            return None
    if policy is not AutoShardPolicy.FILE:
        return None
    per_replica = plan.steps_per_replica()
    if any(s is None for s in per_replica):
        return None
    return max(per_replica)


# -- Dask partitions -----------------------------------------------------------------


def _leaf_futures(extended: StrategyExtended, source: DaskSource) -> list[list[Any]] | None:
    """Per partition, the futures of a persisted source's leaves; ``None`` when not persisted.

    A persisted collection's graph is one future per partition, keyed
    ``(name, i, 0, ...)``; dataframes may expose other (aliased) keys, so the
    futures are matched by partition index.
    """
    from distributed import futures_of

    per_leaf = []
    for collection in source.collections:
        futures = futures_of(collection)
        names = {f.key[0] for f in futures if isinstance(f.key, tuple)}
        count = len(source.partitions)
        if len(names) != 1 or len(futures) != count:
            return None
        by_index = {f.key[1]: f for f in futures}
        if set(by_index) != set(range(count)):
            return None
        per_leaf.append([by_index[i] for i in range(count)])
    return [list(parts) for parts in zip(*per_leaf)]


def _local_bytes(extended: StrategyExtended, source: DaskSource) -> tuple[list[dict[str, int]], list[int]]:
    """Per partition, the bytes each worker already holds (empty: not computed yet), and its size.

    Sizes of persisted partitions come from the scheduler (exact, also for
    dataframes); others are estimated from shapes and dtypes.
    """
    futures = _leaf_futures(extended, source)
    if futures is None:
        return [{} for _ in source.partitions], [p.nbytes for p in source.partitions]
    client = extended.client
    every = [f for parts in futures for f in parts]
    for future in every:  # persisted data may still be computing; wait without pulling it here
        if future.exception() is not None:
            raise future.exception()
    who_has = client.who_has(every)  # takes futures
    nbytes = client.nbytes([f.key for f in every], summary=False)  # takes keys
    local, sizes = [], []
    for parts in futures:
        held: dict[str, int] = {}
        for f in parts:
            for worker in who_has.get(f.key, ()):
                held[worker] = held.get(worker, 0) + int(nbytes.get(f.key, 0))
        local.append(held)
        sizes.append(sum(int(nbytes.get(f.key, 0)) for f in parts))
    return local, sizes


def _place_dask_partitions(extended: StrategyExtended, source: DaskSource, shares: list[list[Partition]],
                           workers: list[str]) -> tuple[list[list[Partition]], list[Any]]:
    """Make every partition's data live on the worker of the replica that reads it.

    Every persisted partition gets a pinned identity task on its reader's
    worker: where the data already is, nothing moves and the task's result
    holds it there for as long as the distributed dataset lives (Dask's active
    memory manager may drop extra copies of the original key); elsewhere Dask
    moves the bytes once. Partitions not yet computed are computed on that
    worker.
    """
    client = extended.client
    persisted = _leaf_futures(extended, source)
    delayed = None if persisted is not None else source.delayed_partitions()
    kept: list[Any] = []
    new_shares: list[list[Partition]] = []
    for rank, share in enumerate(shares):
        worker = workers[rank]
        placed = []
        for partition in share:
            if persisted is not None:
                leaf_futures = []
                for future in persisted[partition.index]:
                    # Always a pinned identity task on the reader's worker, even where the partition already
                    # is (then nothing moves): a copy Dask made for another computation (another
                    # distribution of the same data, say) could otherwise lead its memory manager to drop
                    # the copy this replica reads.
                    leaf_futures.append(client.submit(_identity, future, workers=[worker],
                                                      allow_other_workers=False, pure=False))
            else:
                leaf_futures = client.compute(delayed[partition.index], workers=[worker], allow_other_workers=False)
            kept.extend(leaf_futures)
            placed.append(Partition(partition.index, partition.rows, partition.nbytes,
                                    keys=tuple(f.key for f in leaf_futures)))
        new_shares.append(placed)
    for future in kept:  # wait for placement without pulling data to the client
        error = future.exception()
        if error is not None:
            raise error
    return new_shares, kept
