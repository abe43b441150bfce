"""The replica side of distributed datasets: each replica's shard, its iterators, and their commands.

A ``ReplicaShard`` is what one replica reads: its rows (Dask keys held by
its own worker, or in-memory rows, planned by ``data/planner.py``) and the
pipeline that splits each global batch. Iterators run that pipeline
locally; batches stay on the replica and are referred to from the client by
``BatchRef`` handles, resolved inside ``strategy.run``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import optree

from daskdist import context
from daskdist.data import ops
from daskdist.data.dataset import Dataset
from daskdist.data.options import InputContext
from daskdist.data.sources import DaskSource, Partition, Source
from daskdist.group.service import BATCH, DATASET, ITERATOR

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["BatchRef", "KeyedSource", "ReplicaShard"]

logger = logging.getLogger(__name__)

_BATCHES_KEPT = 4


class KeyedSource(Source):
    """A Dask source as a replica sees it: partitions by key, read from the worker's own memory."""

    def __init__(self, treedef: Any, partitions: list[Partition], assemble: Callable[[list[Any]], Any]):
        self.treedef = treedef
        self.partitions = partitions
        self._assemble = assemble
        self.worker: Any = None  # bound on the replica (loads run in prefetch threads, not worker threads)
        self.fetch_wait = 0.0  # seconds to wait for a holder of a key no worker holds (Dask recomputing it)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "worker": None}

    def load(self, partition: Partition) -> Any:
        worker = self.worker
        values = [worker.data[key] if key in worker.data else _fetch(worker, key, self.fetch_wait)
                  for key in partition.keys]
        return self._assemble(values)


def _fetch(worker: Any, key: Any, wait: float = 0.0) -> Any:
    """Get a key this worker does not hold from a worker that does (rare: the data moved since placement).

    ``wait``: seconds to wait for a holder when none has it (a key whose
    holder was lost, which Dask recomputes because a client holds it).
    """
    from distributed.utils import sync
    from distributed.worker import get_data_from_worker

    deadline = time.monotonic() + wait
    holders = sync(worker.loop, worker.scheduler.who_has, keys=[key]).get(key) or []
    while not holders and time.monotonic() < deadline:
        time.sleep(0.2)
        holders = sync(worker.loop, worker.scheduler.who_has, keys=[key]).get(key) or []
    if not holders:
        raise KeyError(f"no worker holds partition data {key!r}; was the collection released?")
    logger.warning("Partition data %s is not on %s; fetching it from %s", key, worker.address, holders[0])
    response = sync(worker.loop, get_data_from_worker, worker.rpc, [key], holders[0], who=worker.address)
    if response.get("status") != "OK":
        raise RuntimeError(f"could not fetch {key!r} from {holders[0]}: {response.get('status')}")
    return cast(Any, response)["data"][key]  # distributed's TypedDict names only the busy reply


@dataclass
class ReplicaShard:
    """One replica's share of a distributed dataset."""

    dataset: Dataset
    partitions: list[Partition]
    empty_spec: Any  # structure of (shape, dtype) of an element, to build empty batches
    prefetch: int = 2
    to_device: bool = False
    steps: int | None = None  # batches every replica yields per pass, when known in advance
    caches: dict[int, list[Any]] = field(default_factory=dict)
    epochs: int = 0

    def pipeline(self, replica: int, epoch: int | None = None) -> Iterator[Any]:
        """A pass over the shard: the next one, or pass ``epoch`` again (a restored iterator)."""
        if epoch is None:
            epoch = self.epochs
            self.epochs += 1
        state = ops.PipelineState(epoch=epoch, replica=replica, caches=self.caches)
        source = self.dataset.source
        elements = self.dataset._iterate(self.partitions, state, load=source.load)
        if self.prefetch:
            elements = ops.PrefetchIterator(elements, self.prefetch)
        return elements

    def snapshot(self) -> dict[str, Any]:
        """The shard's plan and how many passes it started (``Resident``)."""
        return {"partitions": list(self.partitions), "epochs": self.epochs}

    def restore(self, state: dict[str, Any]) -> None:
        self.partitions = list(state["partitions"])
        self.epochs = int(state["epochs"])

    def empty_batch(self) -> Any:
        return optree.tree_map(
            lambda spec: np.empty((0, *spec[0][1:]), dtype=spec[1]),
            self.empty_spec,
            is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype),
        )


class ReplicaIterator:
    """A pass over a replica's shard, one element per step."""

    def __init__(self, shard: ReplicaShard, replica: int):
        self.shard = shard
        self.replica = replica
        self.epoch = shard.epochs
        self._elements = shard.pipeline(replica)
        self.exhausted = False
        self.position = 0  # elements taken so far in this pass

    def next_element(self) -> Any | None:
        if self.exhausted:
            return None
        try:
            element = next(self._elements)
        except StopIteration:
            self.exhausted = True
            self.close()
            return None
        self.position += 1
        return element

    def snapshot(self) -> dict[str, Any]:
        """Which pass and how far into it (``Resident``)."""
        return {"epoch": self.epoch, "position": self.position, "exhausted": self.exhausted}

    def restore(self, state: dict[str, Any]) -> None:
        """Replay pass ``epoch`` of the shard up to ``position`` (the elements are made again, not stored)."""
        self.close()
        self.epoch, self.position, self.exhausted = int(state["epoch"]), 0, False
        self._elements = self.shard.pipeline(self.replica, epoch=self.epoch)
        for _ in range(int(state["position"])):
            if self.next_element() is None:
                break
        self.exhausted = bool(state["exhausted"]) or self.exhausted

    def close(self) -> None:
        close = getattr(self._elements, "close", None)
        if close is not None:
            close()


def _to_device(element: Any, shard: ReplicaShard, service: ReplicaService) -> Any:
    if not shard.to_device or not any("GPU" in d for d in service.devices):
        return element
    import cupy

    return optree.tree_map(cupy.asarray, element)


# -- commands (run on the replica thread) ------------------------------------------


def register_shard(service: ReplicaService, dataset_id: str, shard: ReplicaShard) -> None:
    if isinstance(shard.dataset.source, KeyedSource):
        shard.dataset.source.worker = service.worker
    service.objects.install(DATASET, dataset_id, shard)


def register_from_function(service: ReplicaService, dataset_id: str, dataset_fn: Callable[[InputContext], Any],
                           prefetch: int) -> Any:
    """Build this replica's dataset with ``dataset_fn(InputContext)``; returns its ``element_spec``."""
    ctx = InputContext(num_input_pipelines=service.size, input_pipeline_id=service.rank, num_replicas_in_sync=service.size)
    dataset = dataset_fn(ctx)
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset_fn must return a daskdist.data.Dataset, got {type(dataset).__name__}")
    source = dataset.source
    partitions = list(source.partitions)
    if isinstance(source, DaskSource):  # collections built inside dataset_fn: computed on this worker
        dataset = Dataset(_ComputedDaskSource(source, service.worker), dataset.transformations)
    element_spec = dataset.element_spec
    spec = optree.tree_map(lambda s: (s.shape, np.dtype(s.dtype)), element_spec)
    service.objects.install(DATASET, dataset_id, ReplicaShard(dataset, partitions, spec, prefetch))
    return element_spec


class _ComputedDaskSource(Source):
    def __init__(self, source: DaskSource, worker: Any):
        self._source = source
        self._worker = worker
        self.partitions = source.partitions

    def load(self, partition: Partition) -> Any:
        delayed = self._source.delayed_partitions()[partition.index]
        client = self._worker._get_client()
        return self._source.assemble(client.compute(delayed, sync=True))


def _batch_id(iterator_id: str, step: int) -> str:
    """The resident id of an iterator's element for ``step`` (kind ``BATCH``)."""
    return f"{iterator_id}:{step}"


def make_iterator(service: ReplicaService, dataset_id: str, iterator_id: str) -> None:
    shard = service.objects.get(DATASET, dataset_id)
    service.objects.install(ITERATOR, iterator_id, ReplicaIterator(shard, service.rank))


def next_batch(service: ReplicaService, iterator_id: str, step: int) -> int:
    """Produce this replica's element for ``step``; returns its rows (-1 once the shard is exhausted)."""
    iterator: ReplicaIterator = service.objects.get(ITERATOR, iterator_id)
    start = time.perf_counter()
    element = iterator.next_element()
    service.timer.add_pending_input(time.perf_counter() - start)
    key = _batch_id(iterator_id, step)
    if element is None:
        service.objects.install(BATCH, key, iterator.shard.empty_batch())
        rows = -1
    else:
        element = _to_device(element, iterator.shard, service)
        service.objects.install(BATCH, key, element)
        leaves: list[Any] = optree.tree_leaves(element)
        first: Any = leaves[0] if leaves else None
        rows = int(len(first)) if first is not None and getattr(first, "ndim", None) else 1
    service.objects.discard(BATCH, _batch_id(iterator_id, step - _BATCHES_KEPT))
    return rows


def close_iterator(service: ReplicaService, iterator_id: str, keep_batches: bool = False) -> None:
    """Stop an iterator's pipeline; drop its batches too unless ``keep_batches`` (handles may still be used)."""
    iterator = service.objects.pop(ITERATOR, iterator_id)
    if iterator is not None:
        iterator.close()
    if not keep_batches:
        for key in service.objects.ids(BATCH):
            if key.startswith(f"{iterator_id}:"):
                service.objects.discard(BATCH, key)


def forget_dataset(service: ReplicaService, dataset_id: str) -> None:
    service.objects.discard(DATASET, dataset_id)


# -- references resolved inside replicas ---------------------------------------------


class BatchRef:
    """A handle to one replica's batch of one step (or one leaf of it); it resolves to arrays inside ``strategy.run``."""

    __slots__ = ("iterator_id", "leaf", "rows", "step", "token")

    def __init__(self, token: str, iterator_id: str, step: int, rows: int, leaf: int | None = None):
        self.token = token
        self.iterator_id = iterator_id
        self.step = step
        self.rows = rows
        self.leaf = leaf

    def __reduce__(self) -> tuple[Any, ...]:
        return (_resolve_batch, (self.token, self.iterator_id, self.step, self.rows, self.leaf))

    def __repr__(self) -> str:
        part = "batch" if self.leaf is None else f"component {self.leaf} of the batch"
        return f"<{part} of step {self.step}: {max(self.rows, 0)} rows, on the replica>"


def _resolve_batch(token: str, iterator_id: str, step: int, rows: int, leaf: int | None = None) -> Any:
    runtime = context.current_runtime()
    if runtime is not None and runtime.token == token:
        try:
            batch = runtime.objects.get(BATCH, _batch_id(iterator_id, step))
        except KeyError:
            raise RuntimeError(
                f"the batch of step {step} is no longer held by replica {runtime.rank}: only the last "
                f"{_BATCHES_KEPT} batches of an iterator are kept"
            ) from None
        return batch if leaf is None else optree.tree_leaves(batch)[leaf]
    return BatchRef(token, iterator_id, step, rows, leaf)


def resolve_dataset(token: str, dataset_id: str) -> Any:
    """Unpickle a distributed dataset: inside a replica, the view that iterates the local shard."""
    runtime = context.current_runtime()
    if runtime is not None and runtime.token == token:
        return ReplicaDatasetView(runtime, runtime.objects.get(DATASET, dataset_id))
    from daskdist import registry

    owner = registry.lookup(token)
    dataset = owner.distributed_dataset(dataset_id) if owner is not None else None
    if dataset is None:
        raise RuntimeError(f"distributed dataset {dataset_id} is not known in this process")
    return dataset


class ReplicaDatasetView:
    """A distributed dataset iterated inside a replica (loops that run on the replicas, such as ``fit``).

    Every replica yields the same number of steps: the plan's step count when
    it is known in advance (row counts known, no op that changes them), else
    each step the replicas agree (a one-number all-reduce) whether any still
    has data; those that ran out yield empty batches until all have.
    """

    def __init__(self, runtime: ReplicaService, shard: ReplicaShard):
        self._runtime = runtime
        self._shard = shard

    def __iter__(self) -> Iterator[Any]:
        iterator = ReplicaIterator(self._shard, self._runtime.rank)
        comm = self._runtime.process_group
        try:
            if self._shard.steps is not None:  # every replica knows how many steps: no agreement needed
                for _ in range(self._shard.steps):
                    start = time.perf_counter()
                    element = iterator.next_element()
                    self._runtime.timer.add_input_wait(time.perf_counter() - start)
                    yield element if element is not None else self._shard.empty_batch()
                return
            while True:
                start = time.perf_counter()
                element = iterator.next_element()
                self._runtime.timer.add_input_wait(time.perf_counter() - start)
                have = comm.all_reduce("SUM", np.array([element is not None], np.int64))
                if int(have[0]) == 0:
                    return
                yield element if element is not None else self._shard.empty_batch()
        finally:
            iterator.close()
