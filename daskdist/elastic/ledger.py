"""The data ledger: which rows of the data each committed step of an elastic ``fit`` consumed.

Rows are named by their *epoch position*: ``0 ... N - 1`` in source order
over the ``(partition, start, stop)`` ranges the epoch reads (``RowMap``).
An ``EpochSchedule`` says which positions each step of one epoch holds: the
epoch's order (source order, or the seeded permutation that stands for a
``shuffle``) cut into global batches, whose size may change mid-epoch under
``keep="per_replica"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from daskdist.data.plan import Plan

__all__ = ["DataLedger", "EpochSchedule", "RowMap", "StepPositions"]


class StepPositions(Protocol):
    """Anything that says which epoch positions a global batch (a step) holds."""

    def positions_of_step(self, step: int) -> np.ndarray: ...


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

    def positions_of_step(self, step: int) -> np.ndarray:
        """The epoch positions global batch ``step`` holds (in source order)."""
        return np.arange(step * self.batch_size, min((step + 1) * self.batch_size, self.total_rows))

    def rows_of_step(self, step: int) -> list[tuple[int, int, int]]:
        """``(partition, start, stop)`` of the rows global batch ``step`` holds."""
        return self.rows_of_positions(self.positions_of_step(step))

    def rows_of_positions(self, positions: np.ndarray) -> list[tuple[int, int, int]]:
        """``(partition, start, stop)`` runs of the given epoch positions, in their order."""
        if len(positions) == 0:
            return []
        starts = np.cumsum([0] + [b - a for _, a, b in self.ranges])
        which = np.searchsorted(starts, positions, side="right") - 1
        out: list[tuple[int, int, int]] = []
        for index, position in zip(which.tolist(), np.asarray(positions).tolist()):
            partition, a, _ = self.ranges[index]
            row = a + position - int(starts[index])
            if out and out[-1][0] == partition and out[-1][2] == row:
                out[-1] = (partition, out[-1][1], row + 1)
            else:
                out.append((partition, row, row + 1))
        return out


@dataclass
class EpochSchedule:
    """Which epoch positions each step of one epoch holds.

    ``order`` is the epoch's row order (``None``: source order, else a
    permutation of ``0 ... total_rows - 1``); ``segments`` are
    ``(first_step, first_row, batch_size)``: from ``first_step`` on, step
    ``first_step + j`` holds rows ``first_row + j * batch_size ...`` of that
    order (a new segment starts when the global batch changes size).
    """

    total_rows: int
    order: np.ndarray | None = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)

    def start(self, first_step: int, first_row: int, batch_size: int) -> None:
        """From ``first_step`` (at row ``first_row`` of the order) on, batches of ``batch_size``."""
        self.segments = [s for s in self.segments if s[0] < first_step]
        self.segments.append((first_step, first_row, batch_size))

    def row_of_step(self, step: int) -> int:
        """The first row (in the epoch's order) of step ``step``."""
        first_step, first_row, size = max((s for s in self.segments if s[0] <= step), default=(0, 0, 0))
        if size == 0:
            raise ValueError(f"no batch size planned for step {step}")
        return min(first_row + (step - first_step) * size, self.total_rows)

    def positions_of_step(self, step: int) -> np.ndarray:
        first_step, first_row, size = max(s for s in self.segments if s[0] <= step)
        lo = min(first_row + (step - first_step) * size, self.total_rows)
        hi = min(lo + size, self.total_rows)
        return np.arange(lo, hi) if self.order is None else self.order[lo:hi]


@dataclass
class DataLedger:
    """Per epoch, per committed step, the epoch positions of the rows it consumed.

    Rolled-back steps are removed (``rollback``), so after ``fit`` each
    epoch's entries are the committed updates only: with a complete epoch,
    every row of the epoch appears exactly once.
    """

    epochs: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)

    def record(self, epoch: int, steps: range, rows: StepPositions) -> None:
        entries = self.epochs.setdefault(epoch, {})
        for step in steps:
            if step in entries:
                raise RuntimeError(f"step {step} of epoch {epoch} was committed twice")
            entries[step] = np.asarray(rows.positions_of_step(step), np.int64)

    def rollback(self, epoch: int, step: int) -> None:
        """Forget the steps of ``epoch`` from ``step`` on, and every later epoch (they are replayed)."""
        for e in [e for e in self.epochs if e > epoch]:
            del self.epochs[e]
        entries = self.epochs.get(epoch, {})
        for s in [s for s in entries if s >= step]:
            del entries[s]

    def steps(self, epoch: int) -> list[int]:
        return sorted(self.epochs.get(epoch, {}))

    def positions(self, epoch: int, rows: RowMap | None = None) -> np.ndarray:
        """The epoch positions (0 ... rows of the epoch - 1) of every committed row of ``epoch``, in step order,
        a row committed twice appearing twice. (``rows`` is accepted for compatibility; positions need no map.)"""
        entries = self.epochs.get(epoch, {})
        parts = [entries[step] for step in sorted(entries)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def rows(self, epoch: int, rows: RowMap) -> list[tuple[int, int, int]]:
        """Every committed row of ``epoch`` as ``(partition, start, stop)`` runs, in step order."""
        return rows.rows_of_positions(self.positions(epoch))
