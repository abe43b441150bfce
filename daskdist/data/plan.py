"""What a distributed dataset reads where: the replica of each row range, the bytes that move, the steps.

Built by ``data/distributed.py`` from the pure functions of ``data/split.py``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

__all__ = ["Plan", "PlannedRead"]


@dataclass
class PlannedRead:
    """Rows ``[start, stop)`` of one partition, or a part of them, read by one replica."""

    partition: int
    replica: int
    worker: str
    start: int
    stop: int
    rows: int  # rows the replica takes from this range (all of them, or its part of each global batch)
    nbytes: int  # bytes of those rows
    moved: int  # of them, bytes that must travel to the replica's worker

    @property
    def index(self) -> int:
        return self.partition


@dataclass
class Plan:
    """Which replica reads which rows of a distributed dataset, and what that costs.

    ``split`` is the rule in force (``"global"``, ``"balanced"``, ``"local"``
    or ``"everything"`` for ``AutoShardPolicy.OFF``); ``batch_sizes`` each
    replica's share of a full global batch (TF's split); ``steps`` the steps of
    one pass when every replica runs the same known number (else ``None``).
    """

    reads: list[PlannedRead]
    workers: list[str]
    batch_sizes: list[int]
    policy: str
    split: str
    steps: int | None = None
    replica_steps: list[int | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def partitions(self) -> list[PlannedRead]:
        """The reads (a partition may be read in parts by several replicas)."""
        return self.reads

    @property
    def bytes_to_move(self) -> int:
        return sum(p.moved for p in self.reads)

    @property
    def bytes_total(self) -> int:
        return sum(p.nbytes for p in self.reads)

    def rows_per_replica(self) -> list[int | None]:
        rows: list[int | None] = [0] * len(self.workers)
        for p in self.reads:
            known = rows[p.replica]
            rows[p.replica] = None if p.rows < 0 or known is None else known + p.rows
        return rows

    def bytes_per_replica(self) -> list[int]:
        out = [0] * len(self.workers)
        for p in self.reads:
            out[p.replica] += p.nbytes
        return out

    def steps_per_replica(self) -> list[int | None]:
        """Batches each replica produces in one pass (``None`` when not known in advance)."""
        if self.replica_steps:
            return list(self.replica_steps)
        return [self.steps] * len(self.workers)

    def __repr__(self) -> str:
        steps = self.steps if self.steps is not None else "?"
        lines = [(f"Plan ({self.policy} sharding, {self.split} split, {len(self.reads)} reads -> "
                  f"{len(self.workers)} replicas, {_fmt_bytes(self.bytes_to_move)} to move of "
                  f"{_fmt_bytes(self.bytes_total)}, steps {steps})")]
        for r, (worker, rows, nbytes, replica_steps, batch) in enumerate(zip(
            self.workers, self.rows_per_replica(), self.bytes_per_replica(), self.steps_per_replica(), self.batch_sizes
        )):
            mine = sorted({p.partition for p in self.reads if p.replica == r})
            lines.append(
                f"  replica {r} on {worker}: partitions {_fmt_list(mine)}, rows {rows if rows is not None else '?'}, "
                f"{_fmt_bytes(nbytes)}, batch {batch}, steps {replica_steps if replica_steps is not None else '?'}"
            )
        for p in self.reads:
            if p.moved:
                lines.append(f"  partition {p.partition} rows {p.start}:{p.stop} move {_fmt_bytes(p.moved)} to {p.worker}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{p.partition}</td><td>{p.start}:{p.stop}</td><td>{p.replica}</td><td>{html.escape(p.worker)}</td>"
            f"<td>{p.rows}</td><td>{_fmt_bytes(p.nbytes)}</td>"
            f"<td>{_fmt_bytes(p.moved) + ' moves' if p.moved else 'local'}</td></tr>"
            for p in self.reads
        )
        notes = "".join(f"<br>note: {html.escape(n)}" for n in self.notes)
        return (
            f"<div><b>Plan</b>: {self.policy} sharding, {self.split} split, "
            f"{_fmt_bytes(self.bytes_to_move)} to move of {_fmt_bytes(self.bytes_total)}{notes}"
            "<table><tr><th>partition</th><th>rows</th><th>replica</th><th>worker</th><th>taken</th><th>bytes</th>"
            f"<th></th></tr>{rows}</table></div>"
        )


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_list(items: list[int]) -> str:
    return "[" + ", ".join(map(str, items[:12])) + (", ..." if len(items) > 12 else "") + "]"
