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
    moved: bool  # its bytes must travel to the replica's worker
    holders: tuple[str, ...] = ()


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
        return sum(p.nbytes for p in self.partitions if p.moved)

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
            lines.append(f"  partition {p.index} moves {_fmt_bytes(p.nbytes)} to {p.worker}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{p.index}</td><td>{p.replica}</td><td>{html.escape(p.worker)}</td><td>{p.rows}</td>"
            f"<td>{_fmt_bytes(p.nbytes)}</td><td>{'moves' if p.moved else 'local'}</td></tr>"
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


def assign_partitions(sizes: list[int], holders: list[set[str]], workers: list[str]) -> tuple[list[int], list[bool]]:
    """Assign partitions to replicas: local first, balanced by bytes, moving as little as possible.

    Parameters
    ----------
    sizes
        Bytes of each partition.
    holders
        Workers already holding each partition (empty: not computed yet; it
        is then computed on the replica that reads it, moving nothing).
    workers
        The worker of each replica.

    Returns
    -------
    replicas, moved
        The replica of each partition, and whether its bytes must move.
    """
    n = len(workers)
    load = [0] * n
    replica_of = [-1] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    # 1. partitions that live on replicas' workers go to the least-loaded such replica
    for i in order:
        local = [r for r in range(n) if workers[r] in holders[i]]
        if local:
            r = min(local, key=lambda r: (load[r], r))
            replica_of[i] = r
            load[r] += sizes[i]
    # 2. partitions not computed yet (or held elsewhere) go where the load is lowest
    for i in order:
        if replica_of[i] < 0:
            r = min(range(n), key=lambda r: (load[r], r))
            replica_of[i] = r
            load[r] += sizes[i]
    # 3. move partitions from the most to the least loaded replica while that narrows the gap
    moved_flags = [bool(holders[i]) and workers[replica_of[i]] not in holders[i] for i in range(len(sizes))]
    for _ in range(len(sizes) * n):
        heavy = max(range(n), key=lambda r: (load[r], -r))
        light = min(range(n), key=lambda r: (load[r], r))
        gap = load[heavy] - load[light]
        candidates = [i for i in range(len(sizes)) if replica_of[i] == heavy and 0 < sizes[i] < gap]
        if not candidates:
            break
        best = max(candidates, key=lambda i: min(sizes[i], gap - sizes[i]))  # closest to half the gap
        if min(sizes[best], gap - sizes[best]) <= 0:
            break
        replica_of[best] = light
        load[heavy] -= sizes[best]
        load[light] += sizes[best]
        moved_flags[best] = bool(holders[best]) and workers[light] not in holders[best]
    return replica_of, moved_flags
