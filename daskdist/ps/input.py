"""Per-worker datasets over Dask collections, read where the partitions are, and the ledger of what was read.

``ClusterCoordinator.create_per_worker_dataset(dataset_fn)`` calls
``dataset_fn(InputContext(num_workers, i))`` for every worker ``i``. When every
pipeline reads the same Dask collections (``Dataset.from_dask``) and begins
with ``shard(num_input_pipelines, input_pipeline_id)``, the shard is made by
*partition and locality* instead of by element (TF's ``AutoShardPolicy.FILE``
in place of ``DATA``): each partition goes to the worker whose Dask worker
holds it (``data.split.homes``: the holder, the least loaded among several),
a worker that would get none takes the smallest partition of the one with
the most, and each worker's pipeline reads its partitions from its own
memory (``KeyedSource``; pinned there so Dask keeps them). Partitions held
by no worker (on a ps, say) move to their assigned worker once.

Every partition a worker loads is logged there with the load's pass (1st,
2nd ... time this worker reads it: ``repeat()``); the coordinator collects
the log with each closure's result and records it in the client's
``ClosureDataLedger`` when the closure commits. A closure whose worker is
lost commits nothing, and the partitions its pipeline held are not read
again in that pass by the survivors (they are not re-assigned): visitation
per pass is *at most once* per partition, and exactly once when no worker
is lost. Loads made ahead by ``shuffle``/``prefetch`` count for the closure
during which they happened.

A worker admitted in place of a lost one (a nanny restart) takes the lost
worker's pipeline over (``LocalityPlan.takeover``): it reads from the
collection's own keys (Dask recomputes those that were lost), skips in its
first sweep the partitions committed closures loaded in the pass in
progress, and numbers its passes on: the pass then completes, each
partition loaded once.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from daskdist import config
from daskdist.data import ops
from daskdist.data.dataset import Dataset
from daskdist.data.options import InputContext
from daskdist.data.placement import DaskRows, Read
from daskdist.data.replica import KeyedSource
from daskdist.data.sources import DaskSource, Partition
from daskdist.data.split import homes
from daskdist.group.service import STRATEGY, ReplicaService

__all__ = ["CONSUMED_KEY", "ClosureDataLedger", "LedgerEntry", "LocalityPlan", "LoggedSource", "drain_consumed",
           "plan_by_locality"]

logger = logging.getLogger(__name__)

#: The resident log of partition loads on a parameter-server worker, drained with each closure's result.
CONSUMED_KEY = (STRATEGY, "ps-consumed")


class LoggedSource(KeyedSource):
    """A worker's partitions of Dask collections, read from its memory, each load logged (partition, rows, pass)."""

    def __init__(self, dataset_key: str, *args: Any):
        super().__init__(*args)
        self.dataset_key = dataset_key
        self._log: Any = None
        self._loads: dict[int, int] = {}
        self.start_loads: dict[int, int] = {}  # a resumed pipeline: passes committed so far, per partition
        self.skip_once: set[int] = set()  # a resumed pipeline: partitions read in the current pass already

    def resumed(self, committed: dict[int, int]) -> LoggedSource:
        """This pipeline for a worker taking it over from a lost one: it goes on with the pass in progress.

        ``committed``: per partition, the loads committed closures made
        (the ledger). The pass in progress is the least of them over this
        pipeline's partitions; in its first sweep the new reader skips the
        partitions already read in that pass, and numbers its loads on
        from the committed ones.
        """
        resumed = copy.copy(self)
        counts = {p.index: int(committed.get(p.index, 0)) for p in self.partitions}
        current = min(counts.values(), default=0)
        resumed.start_loads = counts
        resumed.skip_once = {p for p, n in counts.items() if n > current}
        resumed.fetch_wait = config.get_seconds("parameter-store.lost-data-wait")
        return resumed

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_log": None, "_loads": {}}

    def bind(self, service: ReplicaService) -> None:
        """On the worker: read from its memory, log into its resident log of loads."""
        self.worker = service.worker
        self._loads = dict(self.start_loads)
        log = service.objects.find(*CONSUMED_KEY)
        if log is None:
            log = collections.deque()
            service.objects.install(*CONSUMED_KEY, log)
        self._log = log

    def load(self, partition: Any) -> Any:
        if partition.index in self.skip_once:  # read in this pass by the lost worker's committed closures
            self.skip_once.discard(partition.index)
            return None
        value = super().load(partition)
        passes = self._loads[partition.index] = self._loads.get(partition.index, 0) + 1
        if self._log is not None:
            self._log.append((self.dataset_key, passes - 1, partition.index, int(partition.rows)))
        return value


def drain_consumed(service: ReplicaService) -> list[tuple[str, int, int, int]]:
    """The loads logged on this worker since the last drain: ``(dataset key, pass, partition, rows)``."""
    log = service.objects.find(*CONSUMED_KEY)
    drained = []
    while log:
        drained.append(log.popleft())
    return drained


@dataclass
class LocalityPlan:
    """Each worker's pipeline over its own partitions, and the futures that keep them in place."""

    datasets: list[Dataset]
    partitions: list[list[int]]  # per worker, the partition indices it reads
    holders: dict[int, tuple[str, ...]]  # per partition, the Dask workers that held it when planned
    keep: list[Any] = field(default_factory=list)
    #: Per worker, its pipeline read from the collection's own keys (held by the client: Dask recomputes
    #: them if their worker is lost), for a worker admitted later that takes the pipeline over.
    portable: list[Dataset] = field(default_factory=list)

    def takeover(self, index: int, committed: dict[int, int]) -> Dataset:
        """Pipeline ``index`` for a worker replacing its lost reader (``LoggedSource.resumed``)."""
        dataset = self.portable[index]
        source = dataset.source
        assert isinstance(source, LoggedSource)
        return Dataset(source.resumed(committed), dataset.transformations)


def _leading_shard(dataset: Any, index: int, count: int) -> bool:
    first = dataset.transformations[0] if isinstance(dataset, Dataset) and dataset.transformations else None
    return (isinstance(first, ops.Shard) and first.num_shards == count and first.index == index
            and isinstance(dataset.source, DaskSource))


def plan_by_locality(client: Any, workers: list[str], dataset_fn: Any, dataset_key: str) -> LocalityPlan | None:
    """Each worker's pipeline over the partitions it holds, or ``None`` when ``dataset_fn`` is not of that form.

    Raises
    ------
    ValueError
        Fewer partitions than workers (each worker's pipeline needs one).
    """
    if not callable(dataset_fn) or isinstance(dataset_fn, Dataset):
        return None
    n = len(workers)
    try:
        datasets = [dataset_fn(InputContext(num_input_pipelines=n, input_pipeline_id=i, num_replicas_in_sync=1))
                    for i in range(n)]
    except Exception as e:  # noqa: BLE001 - no context argument, or it needs a worker: it runs on the workers
        logger.debug("dataset_fn is not planned by locality on the client (%s); it runs on each worker", e)
        return None
    if not all(_leading_shard(d, i, n) for i, d in enumerate(datasets)):
        return None
    source: DaskSource = datasets[0].source
    if any(len(d.source.partitions) != len(source.partitions) for d in datasets):
        return None
    if len(source.partitions) < n:
        raise ValueError(f"the Dask collections have {len(source.partitions)} partitions for {n} workers; each "
                         "worker reads whole partitions of its own: repartition to at least one per worker")
    rows = DaskRows(client, source)
    sizes = [rows.partition_bytes(i) for i in range(len(rows.rows))]
    home = _balanced(homes(rows.local_bytes(workers), sizes, n), sizes, n)
    holders = {i: tuple(sorted({w for f in rows.leaf_futures[i] for w in rows.who_has.get(f.key, ())}))
               for i in range(len(rows.rows))}
    plan = LocalityPlan([], [], holders, [])
    for rank, worker in enumerate(workers):
        mine = [i for i, h in enumerate(home) if h == rank]
        reads = [Read(i, 0, rows.rows[i], 0) for i in mine]
        partitions, kept, _ = rows.place(reads, worker)
        plan.keep.extend(kept)
        keyed = LoggedSource(dataset_key, source.treedef, partitions, source.assemble)
        plan.datasets.append(Dataset(keyed, tuple(datasets[rank].transformations[1:])))
        plan.partitions.append(mine)
        own_keys = [Partition(p.index, p.rows, 0, keys=tuple(f.key for f in rows.leaf_futures[p.index]))
                    for p in partitions]
        plan.keep.extend(f for i in mine for f in rows.leaf_futures[i])
        plan.portable.append(Dataset(LoggedSource(dataset_key, source.treedef, own_keys, source.assemble),
                                     tuple(datasets[rank].transformations[1:])))
    return plan


def _balanced(home: list[int], sizes: list[int], n: int) -> list[int]:
    """Give every worker at least one partition: an empty one takes the smallest of the worker with the most."""
    home = list(home)
    for rank in range(n):
        if rank in home:
            continue
        counts = collections.Counter(home)
        donor = max(counts, key=lambda r: (counts[r], -r))
        smallest = min((i for i, h in enumerate(home) if h == donor), key=lambda i: (sizes[i], i))
        home[smallest] = rank
    return home


@dataclass(frozen=True)
class LedgerEntry:
    """One partition load a committed closure accounted for."""

    closure_id: str
    worker: str
    dataset_key: str
    pass_index: int
    partition: int
    rows: int


class ClosureDataLedger:
    """On the client: the partition loads of every committed closure (``coordinator.data_ledger``)."""

    def __init__(self) -> None:
        self._entries: list[LedgerEntry] = []
        self._lock = threading.Lock()

    def record(self, closure_id: str, worker: str, consumed: list[tuple[str, int, int, int]]) -> None:
        with self._lock:
            self._entries.extend(LedgerEntry(closure_id, worker, *entry) for entry in consumed)

    @property
    def entries(self) -> list[LedgerEntry]:
        with self._lock:
            return list(self._entries)

    def partitions(self, dataset_key: str | None = None, pass_index: int = 0) -> dict[int, list[str]]:
        """Per partition, the workers whose committed closures loaded it in pass ``pass_index``."""
        out: dict[int, list[str]] = {}
        for e in self.entries:
            if e.pass_index == pass_index and (dataset_key is None or e.dataset_key == dataset_key):
                out.setdefault(e.partition, []).append(e.worker)
        return out

    def load_counts(self, dataset_key: str) -> dict[int, int]:
        """Per partition of ``dataset_key``, how many times committed closures loaded it (all passes)."""
        return dict(collections.Counter(e.partition for e in self.entries if e.dataset_key == dataset_key))

    def rows(self, dataset_key: str | None = None, pass_index: int = 0) -> int:
        """Rows of the partitions committed closures loaded in pass ``pass_index``."""
        return sum(e.rows for e in self.entries
                   if e.pass_index == pass_index and (dataset_key is None or e.dataset_key == dataset_key))

    def duplicates(self, dataset_key: str | None = None, pass_index: int = 0) -> dict[int, list[str]]:
        """Partitions loaded more than once in one pass (by several workers, or one twice)."""
        return {p: w for p, w in self.partitions(dataset_key, pass_index).items() if len(w) > 1}
