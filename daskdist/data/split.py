"""How global batches are split over replicas, and which rows each replica reads: pure functions.

TensorFlow's rule (``MirroredStrategy.experimental_distribute_dataset``,
checked against TF 2.21): a global batch of ``b`` rows is split so that the
first replicas get ``ceil(b / n)`` rows each and the later ones what is
left, possibly nothing. ``Dataset.range(8).batch(4)`` on 3 replicas gives
``[[0, 1], [2, 3], []]`` then ``[[4, 5], [6, 7], []]``; the last, partial
batch of ``range(11).batch(7)`` gives ``[[7, 8], [9, 10], []]``.

Three ways to choose the rows a replica reads (``InputOptions.experimental_split``):

``"global"``
    Step ``k`` holds exactly the rows of the undistributed dataset's batch
    ``k``; replica ``r`` reads its part of every batch. Rows move to the
    replicas that need them (only those rows).
``"balanced"``
    Every replica reads one run of rows (its worker's partitions, plus
    slices of a neighbour's when it is short); each step it takes as many
    rows as TF's split gives it, so steps and per-replica batch sizes are
    those of ``"global"``, but a step's rows are not the undistributed batch.
``"local"``
    Every replica reads the partitions its worker holds; nothing moves.
    Replicas with fewer rows run out first and get empty batches until all
    have (TF's partial-batch rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "GlobalBatchRows",
    "Piece",
    "SelectedRows",
    "assign_by_locality",
    "balanced_pieces",
    "global_batch_sizes",
    "homes",
    "local_pieces",
    "replica_split",
    "replica_step_sizes",
]

SPLITS = ("global", "balanced", "local")


def replica_split(batch_rows: int, num_replicas: int) -> list[int]:
    """TF's split of one global batch of ``batch_rows`` rows: ``ceil(b/n)`` for the first replicas, the rest what is left."""
    if batch_rows <= 0:
        return [0] * num_replicas
    each = -(-batch_rows // num_replicas)
    return [max(0, min(batch_rows, (r + 1) * each) - r * each) for r in range(num_replicas)]


def global_batch_sizes(total_rows: int, batch_size: int, drop_remainder: bool) -> list[int]:
    """The sizes of the undistributed dataset's batches over ``total_rows`` rows."""
    full, rest = divmod(total_rows, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_remainder else [])


def replica_step_sizes(total_rows: int, batch_size: int, drop_remainder: bool, num_replicas: int) -> list[list[int]]:
    """Per replica, its batch size at each step (TF's split of every global batch)."""
    sizes = [replica_split(b, num_replicas) for b in global_batch_sizes(total_rows, batch_size, drop_remainder)]
    return [[step[r] for step in sizes] for r in range(num_replicas)]


@dataclass(frozen=True)
class GlobalBatchRows:
    """Which global row positions one replica takes under the ``"global"`` split (a picklable mask)."""

    total_rows: int
    batch_size: int
    drop_remainder: bool
    num_replicas: int
    rank: int

    def mask(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        batch = positions // self.batch_size
        offset = positions - batch * self.batch_size
        last = self.total_rows // self.batch_size  # index of the partial batch, if any
        rows_in_batch = np.where(batch < last, self.batch_size, self.total_rows - last * self.batch_size)
        if self.drop_remainder:
            rows_in_batch = np.where(batch < last, rows_in_batch, 0)
        each = -(-rows_in_batch // self.num_replicas)
        low = self.rank * each
        mask: np.ndarray = (positions < self.total_rows) & (offset >= low) & (offset < low + each) & (offset < rows_in_batch)
        return mask


@dataclass(frozen=True, eq=False)
class SelectedRows:
    """The rows one replica takes of one read, chosen on the client (a picklable mask).

    ``keep[i]`` says whether global position ``first + i`` is taken. Used
    when a ``Gather`` before the batch reorders rows: which rows a replica
    takes then depends on each row's place in the gathered order, which the
    planner computes once and ships as this mask (the rows of one read only).
    """

    first: int
    keep: np.ndarray

    def mask(self, positions: np.ndarray) -> np.ndarray:
        index = np.asarray(positions, dtype=np.int64) - self.first
        inside = (index >= 0) & (index < len(self.keep))
        out = np.zeros(index.shape, bool)
        out[inside] = self.keep[index[inside]]
        return out


def assign_by_locality(owner: np.ndarray, batch_size: int, drop_remainder: bool, num_replicas: int) -> np.ndarray:
    """The replica of each row of a gathered (reordered) pass: each global batch's rows go where they live.

    Parameters
    ----------
    owner
        Per row of the pass, in its order, the replica whose worker holds it.
    batch_size, drop_remainder
        The global batch.
    num_replicas
        Replicas in the group.

    Returns
    -------
    Per row, the replica that takes it (``-1``: dropped with a partial last
    batch). Each global batch keeps its rows, and each replica takes TF's
    share of it (``replica_split``): first rows its worker holds, then the
    batch's leftover rows fill the replicas still short, in replica order.
    Which replica takes which row of a batch changes nothing in a step's
    arithmetic beyond the order of a sum (the rows of a reordered batch are
    not contiguous anyway), and it keeps most rows where they are.
    """
    owner = np.asarray(owner, dtype=np.int64)
    assigned = np.full(len(owner), -1, np.int64)
    first = 0
    for size in global_batch_sizes(len(owner), batch_size, drop_remainder):
        batch = owner[first : first + size]
        want = replica_split(size, num_replicas)
        mine = np.full(size, -1, np.int64)
        for replica in range(num_replicas):
            local = np.flatnonzero(batch == replica)[: want[replica]]
            mine[local] = replica
        short = [want[r] - int((mine == r).sum()) for r in range(num_replicas)]
        mine[mine < 0] = np.repeat(np.arange(num_replicas), short)
        assigned[first : first + size] = mine
        first += size
    return assigned


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of one partition, read by one replica."""

    partition: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def local_pieces(rows: list[int], home: list[int], num_replicas: int) -> list[list[Piece]]:
    """``"local"``: every replica reads the whole partitions of its own worker."""
    shares: list[list[Piece]] = [[] for _ in range(num_replicas)]
    for index, (count, replica) in enumerate(zip(rows, home)):
        shares[replica].append(Piece(index, 0, count))
    return shares


def balanced_pieces(rows: list[int], home: list[int], targets: list[int]) -> list[list[Piece]]:
    """``"balanced"``: each replica keeps its own rows up to its target; the surplus fills the others.

    Parameters
    ----------
    rows
        Rows of each partition.
    home
        The replica whose worker holds each partition.
    targets
        Rows each replica must read (they sum to the rows used).

    Returns
    -------
    Per replica, its pieces in row order. Only rows that a short replica
    needs are read away from their home (slices of a neighbour's partitions).
    """
    n = len(targets)
    shares: list[list[Piece]] = [[] for _ in range(n)]
    room = list(targets)
    surplus: list[Piece] = []
    for index, (count, replica) in enumerate(zip(rows, home)):
        keep = min(count, room[replica])
        if keep:
            shares[replica].append(Piece(index, 0, keep))
            room[replica] -= keep
        if keep < count:
            surplus.append(Piece(index, keep, count))
    # surplus rows go to the short replicas, in replica order
    short = [r for r in range(n) if room[r] > 0]
    for piece in surplus:
        start = piece.start
        while start < piece.stop and short:
            r = short[0]
            take = min(room[r], piece.stop - start)
            shares[r].append(Piece(piece.partition, start, start + take))
            room[r] -= take
            start += take
            if room[r] == 0:
                short.pop(0)
    for share in shares:
        share.sort(key=lambda p: (p.partition, p.start))
    return shares


def homes(local_bytes: list[dict[int, int]], sizes: list[int], num_replicas: int) -> list[int]:
    """The replica of each partition: among those whose worker holds most of it, the least loaded."""
    load = [0] * num_replicas
    home = [-1] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    for i in order:
        held = local_bytes[i]
        if held and max(held.values()) > 0:
            best = max(held.values())
            candidates = [r for r, b in held.items() if b == best]
            r = min(candidates, key=lambda r: (load[r], r))
            home[i] = r
            load[r] += sizes[i]
    for i in order:
        if home[i] < 0:
            r = min(range(num_replicas), key=lambda r: (load[r], r))
            home[i] = r
            load[r] += sizes[i]
    return home
