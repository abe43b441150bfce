"""Distributed datasets on the client: plan, placement of partitions, iterators of ``PerReplica`` handles."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

from daskdist.data import replica as replica_side
from daskdist.data.dataset import Dataset
from daskdist.data.options import InputContext, InputOptions
from daskdist.data.plan import Plan
from daskdist.data.planner import Planned, plan_dataset
from daskdist.exceptions import OutOfRangeError
from daskdist.values import PerReplica

if TYPE_CHECKING:
    from daskdist.data.host import DatasetHost

__all__ = ["DistributedDataset", "DistributedIterator", "OutOfRangeError", "Optional"]

logger = logging.getLogger(__name__)


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


class DistributedDataset:
    """A dataset whose partitions are read by the replicas, where they live.

    Iterating on the client yields ``PerReplica`` handles (the arrays stay on
    the replicas); passed to ``strategy.run`` each resolves to that replica's
    batch. Captured by a function that runs on the replicas, it iterates the
    replica's own shard.
    """

    def __init__(self, extended: DatasetHost, dataset_id: str, plan: Plan | None, element_spec: Any,
                 futures: list[Any] | None = None):
        self._extended = extended
        self._id = dataset_id
        self._plan = plan
        self._element_spec = element_spec
        self._futures = futures or []  # keep the placed partitions alive on their workers
        self._pinned: list[tuple[str, Any]] = []  # (worker, future) of the tasks that hold each replica's rows
        self.dataset: Dataset | None = None  # the undistributed dataset (``from_dataset``)
        self._iterators = itertools.count(1)

    # -- building -------------------------------------------------------------------

    @classmethod
    def from_dataset(cls, extended: DatasetHost, dataset: Any, options: InputOptions | None,
                     planned: Planned | None = None) -> DistributedDataset:
        """``dataset`` planned over the replicas (``planned``: that plan, made already) and registered there."""
        options = options or InputOptions()
        if not isinstance(dataset, Dataset):
            raise TypeError(
                "experimental_distribute_dataset takes a daskdist.data.Dataset; build one with "
                "dd.data.Dataset.from_dask(...), .from_tensor_slices(...) or .range(...) "
                f"(got {type(dataset).__module__}.{type(dataset).__name__})"
            )
        element_spec = dataset.element_spec_with(extended.client)
        spec = optree.tree_map(lambda s: (s.shape, np.dtype(s.dtype)), element_spec)
        if planned is None:
            planned = plan_dataset(extended.client, list(extended.worker_addresses), dataset, options)
        dataset_id = uuid.uuid4().hex[:12]
        shards = []
        for replica_input in planned.inputs:
            shards.append((dataset_id, replica_side.ReplicaShard(
                replica_input.dataset, replica_input.partitions, spec,
                options.experimental_per_replica_buffer_size, options.experimental_fetch_to_device, planned.steps,
            )))
        extended.run_on_replicas(replica_side.register_shard, args_per_replica=shards)
        distributed = cls(extended, dataset_id, planned.plan, element_spec, planned.futures)
        distributed.dataset = dataset  # what it was made from: elastic training plans the rest of an epoch again
        distributed._pinned = planned.pinned
        extended.register_distributed_dataset(dataset_id, distributed)
        logger.debug("%r", planned.plan)
        return distributed

    @classmethod
    def from_function(cls, extended: DatasetHost, dataset_fn: Callable[[InputContext], Any],
                      options: InputOptions | None) -> DistributedDataset:
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        options = options or InputOptions()
        dataset_id = uuid.uuid4().hex[:12]
        specs = extended.run_on_replicas(replica_side.register_from_function,
                                         (dataset_id, dataset_fn, options.experimental_per_replica_buffer_size))
        structures = {optree.tree_structure(s) for s in specs}
        # each replica built its own dataset: elements are split by leaf when every replica's has the same structure
        distributed = cls(extended, dataset_id, None, specs[0] if len(structures) == 1 else None)
        extended.register_distributed_dataset(dataset_id, distributed)
        return distributed

    # -- use -------------------------------------------------------------------------

    def plan(self) -> Plan:
        """The partition -> replica map, the bytes that must move and the steps of each replica."""
        if self._plan is None:
            raise ValueError("datasets from distribute_datasets_from_function have no plan: each replica builds its own")
        return self._plan

    @property
    def dataset_id(self) -> str:
        """The id the replicas keep this dataset's shards under (``daskdist.data.replica.forget_dataset``)."""
        return self._id

    @property
    def element_spec(self) -> Any:
        return self._element_spec

    def __iter__(self) -> DistributedIterator:
        iterator = DistributedIterator(self._extended, self._id, f"{self._id}-{next(self._iterators)}",
                                       self._element_spec)
        iterator._dataset = self  # the placed rows live as long as an iterator over them
        return iterator

    def __reduce__(self) -> tuple[Any, ...]:
        return (replica_side.resolve_dataset, (self._extended.token, self._id))

    def _repr_html_(self) -> str:
        return self._plan._repr_html_() if self._plan is not None else "<b>DistributedDataset</b> (from a function)"


class DistributedIterator:
    """Steps through a distributed dataset; each element is a ``PerReplica`` of replica-held batches.

    Every replica stops at the same step: the iteration ends when all
    replicas are out of data; before that, a replica that ran out gets an
    empty batch (TF's partial-batch behaviour).
    """

    def __init__(self, extended: DatasetHost, dataset_id: str, iterator_id: str, element_spec: Any):
        self._extended = extended
        self._iterator_id = iterator_id
        self._element_spec = element_spec
        self._dataset: DistributedDataset | None = None  # keeps the placed rows alive while iterating
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
        return self._element_of_handles(step, rows)

    def _element_of_handles(self, step: int, rows: list[int]) -> Any:
        """The element's structure with a ``PerReplica`` of replica-held arrays at each leaf (TF's shape)."""
        token = self._extended.token
        if self._element_spec is None:  # distribute_datasets_from_function: the structure is the replicas'
            refs = [replica_side.BatchRef(token, self._iterator_id, step, r) for r in rows]
            return refs[0] if len(refs) == 1 else PerReplica(refs)
        specs, treedef = optree.tree_flatten(self._element_spec)
        leaves = []
        for index in range(len(specs)):
            refs = [replica_side.BatchRef(token, self._iterator_id, step, r, index) for r in rows]
            leaves.append(refs[0] if len(refs) == 1 else PerReplica(refs))
        return optree.tree_unflatten(treedef, leaves)

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
