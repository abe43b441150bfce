"""Dask partitions on the cluster: where they are, how many rows, and putting each replica's rows on its worker.

A source's collections are persisted first (a no-op for persisted ones), so
an array derived from a persisted dataframe is read as the array it is, with
its own chunks computed where Dask puts them (next to their inputs). Then
each replica's row ranges get pinned tasks on its worker: the partition
itself where the worker holds it (nothing moves), or a slice cut on the
worker that holds it and sent over (only the rows needed move).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist.cluster.identity import scheduler_workers
from daskdist.data.sources import DaskSource, Partition
from daskdist.data.split import GlobalBatchRows, SelectedRows
from daskdist.exceptions import ReplicaLostError

if TYPE_CHECKING:
    from distributed import Client, Future

__all__ = ["DaskRows", "Read", "select_rows"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Read:
    """What one replica reads of one partition: rows ``[start, stop)``, or its part of them under ``rule``."""

    partition: int
    start: int
    stop: int
    first_position: int  # global position of the partition's row 0 (for ``rule``)
    rule: GlobalBatchRows | SelectedRows | None = None


def select_rows(value: Any, start: int, stop: int, first_position: int, rule: GlobalBatchRows | SelectedRows | None) -> Any:
    """Rows ``[start, stop)`` of a partition's value (numpy, cupy, pandas), keeping only ``rule``'s rows."""
    take = value.iloc if hasattr(value, "iloc") else value
    part = take[start:stop]
    if rule is not None:
        mask = rule.mask(first_position + np.arange(start, stop))
        part = (part.iloc if hasattr(part, "iloc") else part)[mask]
    return part


def _identity(x: Any) -> Any:
    return x


class DaskRows:
    """A Dask source persisted on the cluster: per partition its leaves' futures, holders, bytes and rows."""

    def __init__(self, client: Client, source: DaskSource):
        from distributed import futures_of

        self.client = client
        self.source = source
        # one by one: mixing expressions and graphs
        persisted = [client.persist(c) for c in source.collections]  # type: ignore[no-untyped-call]
        self.leaf_futures: list[list[Future[Any]]] = []  # per partition, one future per leaf
        per_leaf = []
        for collection in persisted:
            per_leaf.append(_partition_futures(collection, futures_of(collection)))  # type: ignore[no-untyped-call]
        self.leaf_futures = [list(parts) for parts in zip(*per_leaf)]
        every = [f for parts in self.leaf_futures for f in parts]
        for future in every:  # wait without pulling data here
            if future.exception() is not None:  # type: ignore[no-untyped-call]
                raise future.exception()  # type: ignore[no-untyped-call]
        self.who_has = client.who_has(every)  # type: ignore[no-untyped-call]
        self.nbytes = client.nbytes([f.key for f in every], summary=False)  # type: ignore[no-untyped-call]
        self.rows = self._rows()

    def _rows(self) -> list[int]:
        known = [p.rows for p in self.source.partitions]
        if all(r >= 0 for r in known):
            return known
        counts = self.client.gather(self.client.map(len, [parts[0] for parts in self.leaf_futures], pure=False))  # type: ignore[no-untyped-call]
        return [int(c) for c in counts]

    def partition_bytes(self, index: int) -> int:
        return sum(int(self.nbytes.get(f.key, 0)) for f in self.leaf_futures[index])

    def local_bytes(self, workers: list[str]) -> list[dict[int, int]]:
        """Per partition, the bytes of it each replica's worker holds (keyed by replica)."""
        out = []
        for parts in self.leaf_futures:
            held: dict[int, int] = {}
            for f in parts:
                for worker in self.who_has.get(f.key, ()):
                    for replica, address in enumerate(workers):
                        if address == worker:
                            held[replica] = held.get(replica, 0) + int(self.nbytes.get(f.key, 0))
            out.append(held)
        return out

    def place(self, reads: list[Read], worker: str) -> tuple[list[Partition], list[Future[Any]], list[int]]:
        """Put ``reads`` on ``worker``; returns the replica's partitions (by key), the futures, the bytes moved.

        ``self.pinned`` collects ``(worker, future)`` of every task holding a replica's rows.
        """
        client = self.client
        placed, kept, moved = [], [], []
        targets = {worker}  # the workers the tasks below are pinned to
        if not hasattr(self, "pinned"):
            self.pinned: list[tuple[str, Future[Any]]] = []
        for read in reads:
            full = read.start == 0 and read.stop == self.rows[read.partition] and read.rule is None
            keys, read_moved = [], 0
            for future in self.leaf_futures[read.partition]:
                holders = self.who_has.get(future.key, ())
                source = future
                if not full:  # cut the rows where the leaf is, so that only they travel
                    where = worker if worker in holders else (holders[0] if holders else worker)
                    targets.add(where)
                    source = client.submit(select_rows, future, read.start, read.stop, read.first_position, read.rule,
                                           workers=[where], allow_other_workers=False, pure=False)
                    kept.append(source)
                # A pinned identity task on the reader's worker, even where the data already is (then nothing
                # moves): Dask's memory manager could otherwise drop the copy this replica reads.
                pinned = client.submit(_identity, source, workers=[worker], allow_other_workers=False, pure=False)
                kept.append(pinned)
                self.pinned.append((worker, pinned))
                keys.append(pinned.key)
                if worker not in holders:
                    read_moved += int(self.nbytes.get(future.key, 0) * self._fraction(read))
            placed.append(Partition(read.partition, self._taken(read), 0, keys=tuple(keys)))
            moved.append(read_moved)
        _wait_while_alive(client, kept, targets)
        for future in kept:
            error = future.exception()  # type: ignore[no-untyped-call]
            if error is not None:
                raise error
        return placed, kept, moved

    def _taken(self, read: Read) -> int:
        if read.rule is None:
            return read.stop - read.start
        return int(read.rule.mask(read.first_position + np.arange(read.start, read.stop)).sum())

    def _fraction(self, read: Read) -> float:
        rows = self.rows[read.partition]
        return self._taken(read) / rows if rows else 0.0


def _wait_while_alive(client: Client, futures: list[Future[Any]], workers: set[str], poll: float = 0.5) -> None:
    """Wait for ``futures``, pinned to ``workers``; a worker that leaves meanwhile raises ``ReplicaLostError``.

    A task pinned to a worker that left the cluster waits for it for ever
    (Dask keeps it as ``no-worker``), so a plan placed while a replica's
    worker dies would never finish: say which worker left instead, so that an
    elastic ``fit`` recovers and a plain one fails clearly.
    """
    for future in futures:
        while True:
            try:
                future.exception(timeout=poll)  # type: ignore[no-untyped-call]
                break
            except TimeoutError:
                alive = set(scheduler_workers(client))
                gone = sorted(workers - alive)
                if gone:
                    raise ReplicaLostError(
                        f"worker {gone[0]} left the cluster while the input was placed on it", worker=gone[0]
                    ) from None


def _partition_futures(collection: Any, futures: list[Future[Any]]) -> list[Future[Any]]:
    """The futures of a persisted collection's partitions, in order.

    Persisted dataframes may expose aliased output keys (dask-expr wraps the
    futures in a new layer), so futures are matched by partition index when
    the keys themselves do not match.
    """
    by_key = {f.key: f for f in futures}
    keys = _partition_keys(collection)
    if all(k in by_key for k in keys):
        return [by_key[k] for k in keys]
    names = {f.key[0] for f in futures if isinstance(f.key, tuple)}
    by_index = {f.key[1]: f for f in futures if isinstance(f.key, tuple)}
    if len(names) == 1 and set(by_index) == set(range(len(keys))):
        return [by_index[i] for i in range(len(keys))]
    raise RuntimeError(f"could not find the persisted partitions of {type(collection).__name__} {keys[:1]}...")


def _partition_keys(collection: Any) -> list[Any]:
    """The output keys of a collection's partitions, in order (chunks along axis 0 for arrays)."""
    keys = collection.__dask_keys__()
    flat = []

    def walk(k: Any) -> None:
        if isinstance(k, list):
            for item in k:
                walk(item)
        else:
            flat.append(k)

    walk(keys)
    return flat
