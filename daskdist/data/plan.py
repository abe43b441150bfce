"""Which replica reads which partition: where the data already is, balanced by bytes.

Pure functions over partition sizes and holders, so the policy is
unit-tested without a cluster.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

__all__ = ["Plan", "PlannedPartition", "assign_partitions"]


@dataclass
class PlannedPartition:
    """One partition's place in the plan."""

    index: int
    replica: int
    worker: str
    nbytes: int
    rows: int
    moved: int  # bytes that must travel to the replica's worker


@dataclass
class Plan:
    """The partition -> replica map of a distributed dataset, with what it costs."""

    partitions: list[PlannedPartition]
    workers: list[str]
    batch_sizes: list[int]
    policy: str
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_to_move(self) -> int:
        return sum(p.moved for p in self.partitions)

    def rows_per_replica(self) -> list[int | None]:
        rows: list[int | None] = [0] * len(self.workers)
        for p in self.partitions:
            if p.rows < 0 or rows[p.replica] is None:
                rows[p.replica] = None
            else:
                rows[p.replica] += p.rows
        return rows

    def bytes_per_replica(self) -> list[int]:
        out = [0] * len(self.workers)
        for p in self.partitions:
            out[p.replica] += p.nbytes
        return out

    def steps_per_replica(self) -> list[int | None]:
        """Batches each replica produces in one pass (``None`` when row counts are unknown)."""
        steps = []
        for rows, batch in zip(self.rows_per_replica(), self.batch_sizes):
            steps.append(None if rows is None or not batch else -(-rows // batch))
        return steps

    def __repr__(self) -> str:
        lines = [f"Plan ({self.policy} sharding, {len(self.partitions)} partitions -> {len(self.workers)} replicas, "
                 f"{_fmt_bytes(self.bytes_to_move)} to move)"]
        for r, (worker, rows, nbytes, steps, batch) in enumerate(zip(
            self.workers, self.rows_per_replica(), self.bytes_per_replica(), self.steps_per_replica(), self.batch_sizes
        )):
            mine = [p.index for p in self.partitions if p.replica == r]
            lines.append(
                f"  replica {r} on {worker}: partitions {_fmt_list(mine)}, rows {rows if rows is not None else '?'}, "
                f"{_fmt_bytes(nbytes)}, batch {batch}, steps {steps if steps is not None else '?'}"
            )
        moved = [p for p in self.partitions if p.moved]
        for p in moved:
            lines.append(f"  partition {p.index} moves {_fmt_bytes(p.moved)} to {p.worker}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{p.index}</td><td>{p.replica}</td><td>{html.escape(p.worker)}</td><td>{p.rows}</td>"
            f"<td>{_fmt_bytes(p.nbytes)}</td><td>{_fmt_bytes(p.moved) + ' moves' if p.moved else 'local'}</td></tr>"
            for p in self.partitions
        )
        return (
            f"<div><b>Plan</b>: {self.policy} sharding, {_fmt_bytes(self.bytes_to_move)} to move"
            "<table><tr><th>partition</th><th>replica</th><th>worker</th><th>rows</th><th>bytes</th><th></th></tr>"
            f"{rows}</table></div>"
        )


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_list(items: list[int]) -> str:
    return "[" + ", ".join(map(str, items[:12])) + (", ..." if len(items) > 12 else "") + "]"


def assign_partitions(sizes: list[int], local: list[dict[str, int]], workers: list[str]) -> tuple[list[int], list[int]]:
    """Assign partitions to replicas: where their bytes already are, balanced by bytes, moving little.

    Parameters
    ----------
    sizes
        Bytes of each partition.
    local
        Per partition, the bytes of it each worker already holds (empty: not
        computed yet; it is then computed on the replica that reads it, and
        nothing moves).
    workers
        The worker of each replica.

    Returns
    -------
    replicas, moved
        The replica of each partition, and how many of its bytes must move there.
    """
    n = len(workers)
    if sizes and not any(sizes):  # sizes unknown (dataframes): balance the number of partitions
        sizes = [1] * len(sizes)
    load = [0] * n
    replica_of = [-1] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])

    def cost(i: int, r: int) -> int:
        return sizes[i] - local[i].get(workers[r], 0) if local[i] else 0

    # 1. each computed partition goes to the least-loaded replica among those holding most of it
    for i in order:
        if not local[i]:
            continue
        best_local = max(local[i].get(w, 0) for w in workers)
        if best_local == 0:
            continue
        candidates = [r for r in range(n) if local[i].get(workers[r], 0) == best_local]
        r = min(candidates, key=lambda r: (load[r], r))
        replica_of[i] = r
        load[r] += sizes[i]
    # 2. the rest (not computed, or held by other workers) go where the load is lowest
    for i in order:
        if replica_of[i] < 0:
            r = min(range(n), key=lambda r: (load[r], r))
            replica_of[i] = r
            load[r] += sizes[i]
    # 3. move partitions from the most to the least loaded replica while that narrows the gap
    for _ in range(len(sizes) * n):
        heavy = max(range(n), key=lambda r: (load[r], -r))
        light = min(range(n), key=lambda r: (load[r], r))
        gap = load[heavy] - load[light]
        candidates = [i for i in range(len(sizes)) if replica_of[i] == heavy and 0 < sizes[i] < gap]
        if not candidates:
            break
        best = max(candidates, key=lambda i: (min(sizes[i], gap - sizes[i]), -cost(i, light)))
        replica_of[best] = light
        load[heavy] -= sizes[best]
        load[light] += sizes[best]
    return replica_of, [cost(i, replica_of[i]) for i in range(len(sizes))]
