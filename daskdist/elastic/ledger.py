"""The data ledger: which rows of the data each committed step of an elastic ``fit`` consumed."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from daskdist.data.plan import Plan

__all__ = ["DataLedger", "RowMap"]


@dataclass(frozen=True)
class RowMap:
    """The rows one epoch reads, in order: ``ranges`` of ``(partition, start, stop)``, batched by ``batch_size``.

    Built from a plan of the ``"global"`` split, where step ``k`` is exactly
    the undistributed dataset's batch ``k``: rows ``[k * B, (k + 1) * B)``
    of the epoch.
    """

    ranges: tuple[tuple[int, int, int], ...]
    batch_size: int
    steps: int

    @classmethod
    def from_plan(cls, plan: Plan, batch_size: int) -> RowMap:
        spans: dict[int, list[int]] = {}
        for read in plan.reads:
            lo, hi = spans.get(read.partition, [read.start, read.stop])
            spans[read.partition] = [min(lo, read.start), max(hi, read.stop)]
        ranges = tuple((p, a, b) for p, (a, b) in sorted(spans.items()))
        return cls(ranges, batch_size, int(plan.steps or 0))

    @property
    def total_rows(self) -> int:
        return sum(b - a for _, a, b in self.ranges)

    def rows_of_step(self, step: int) -> list[tuple[int, int, int]]:
        """``(partition, start, stop)`` of the rows global batch ``step`` holds."""
        lo, hi = step * self.batch_size, min((step + 1) * self.batch_size, self.total_rows)
        out, first = [], 0
        for partition, a, b in self.ranges:
            n = b - a
            s, e = max(lo, first), min(hi, first + n)
            if e > s:
                out.append((partition, a + s - first, a + e - first))
            first += n
        return out


@dataclass
class DataLedger:
    """Per epoch, per committed step, the ``(partition, start, stop)`` row ranges it consumed.

    Rolled-back steps are removed (``rollback``), so after ``fit`` each
    epoch's entries are the committed updates only: with a complete epoch,
    every row of the epoch appears exactly once.
    """

    epochs: dict[int, dict[int, list[tuple[int, int, int]]]] = field(default_factory=dict)

    def record(self, epoch: int, steps: range, rows: RowMap) -> None:
        entries = self.epochs.setdefault(epoch, {})
        for step in steps:
            if step in entries:
                raise RuntimeError(f"step {step} of epoch {epoch} was committed twice")
            entries[step] = rows.rows_of_step(step)

    def rollback(self, epoch: int, step: int) -> None:
        """Forget the steps of ``epoch`` from ``step`` on, and every later epoch (they are replayed)."""
        for e in [e for e in self.epochs if e > epoch]:
            del self.epochs[e]
        entries = self.epochs.get(epoch, {})
        for s in [s for s in entries if s >= step]:
            del entries[s]

    def steps(self, epoch: int) -> list[int]:
        return sorted(self.epochs.get(epoch, {}))

    def rows(self, epoch: int) -> list[tuple[int, int, int]]:
        """Every committed row range of ``epoch``, in step order."""
        entries = self.epochs.get(epoch, {})
        return [r for step in sorted(entries) for r in entries[step]]

    def positions(self, epoch: int, rows: RowMap) -> np.ndarray:
        """The epoch positions (0 ... rows of the epoch - 1) of every committed row of ``epoch``, in step order,
        a row committed twice appearing twice."""
        firsts, first = {}, 0
        for partition, a, b in rows.ranges:
            firsts[partition] = first - a
            first += b - a
        parts = [np.arange(a, b) + firsts[p] for p, a, b in self.rows(epoch)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)
