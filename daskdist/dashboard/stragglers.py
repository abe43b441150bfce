"""Which replica the others waited for, in each collective of a group.

Every replica records how long it spent in each collective of a step
(``StepTiming.collective_times``: ``[run_id, seq, kind, seconds]``, the same
``(run_id, seq)`` on every replica). The replica that arrives last at a
collective waits the least, so once all replicas have reported one
collective, the one with the shortest duration is its straggler and the
spread of the durations (max - min) is how long the earliest replica waited
for it. Collectives whose wait is below ``min_wait``
(``daskdist.metrics.straggler-min-wait``) count as balanced: they stay in the
recent list but are not charged to anyone.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StragglerTotals", "StragglerTracker", "collective_ranges"]


def collective_ranges(collective_times: Iterable[list[Any]]) -> list[list[int]]:
    """``[run_id, first seq, last seq]`` per run of a step's ``collective_times`` (a compact record of them)."""
    ranges: dict[int, list[int]] = {}
    for run_id, seq, _kind, _seconds in collective_times:
        run_id, seq = int(run_id), int(seq)
        span = ranges.get(run_id)
        if span is None:
            ranges[run_id] = [seq, seq]
        else:
            span[0], span[1] = min(span[0], seq), max(span[1], seq)
    return [[run_id, first, last] for run_id, (first, last) in ranges.items()]


@dataclass
class StragglerTotals:
    """Collectives in which one replica was waited for (``count``) and the wait it caused (seconds)."""

    count: int = 0
    wait: float = 0.0

    @property
    def mean_wait(self) -> float:
        return self.wait / self.count if self.count else 0.0


@dataclass
class StragglerTracker:
    """Aligns the replicas' collective durations of one group and attributes each collective.

    Parameters
    ----------
    history
        Attributed collectives kept (``recent``); collectives still waiting for
        some replica's report are bounded to four times as many (oldest dropped).
    min_wait
        Waits below this (seconds) charge no straggler.
    """

    history: int = 1000
    min_wait: float = 0.001
    size: int = 0
    pending: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    recent: collections.deque[Any] = field(default_factory=collections.deque)
    totals: dict[int, StragglerTotals] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.recent = collections.deque(self.recent, maxlen=self.history)

    def add(self, rank: int, collective_times: Iterable[list[Any]]) -> None:
        """Take one replica's ``collective_times`` of one step."""
        if self.size < 2:
            return
        for run_id, seq, kind, seconds in collective_times:
            key = (int(run_id), int(seq))
            entry = self.pending.get(key)
            if entry is None:
                entry = self.pending[key] = {"kind": kind, "times": {}}
            entry["times"][rank] = float(seconds)
            if len(entry["times"]) >= self.size:
                del self.pending[key]
                self._attribute(key, entry["kind"], entry["times"])
        while len(self.pending) > 4 * self.history:
            del self.pending[next(iter(self.pending))]

    def _attribute(self, key: tuple[int, int], kind: str, times: dict[int, float]) -> None:
        straggler = min(times, key=lambda r: (times[r], r))
        wait = max(times.values()) - times[straggler]
        self.recent.append({"run_id": key[0], "seq": key[1], "kind": kind, "replica": straggler, "wait": wait})
        if wait >= self.min_wait:
            totals = self.totals.setdefault(straggler, StragglerTotals())
            totals.count += 1
            totals.wait += wait

    def collectives(self, ranges: Iterable[list[int]] | None = None) -> list[dict[str, Any]]:
        """Attributed collectives, oldest first; with ``ranges`` (``[run_id, first, last]`` seqs), those in them."""
        if ranges is None:
            return list(self.recent)
        by_run: dict[int, list[tuple[int, int]]] = {}
        for run_id, first, last in ranges:
            by_run.setdefault(run_id, []).append((first, last))
        return [c for c in self.recent
                if any(first <= c["seq"] <= last for first, last in by_run.get(c["run_id"], ()))]

    def summary(self, collectives: Iterable[dict[str, Any]]) -> dict[int, StragglerTotals]:
        """Per replica (rank order), how often ``collectives`` waited for it and the wait it caused."""
        out: dict[int, StragglerTotals] = {}
        for c in collectives:
            if c["wait"] >= self.min_wait:
                totals = out.setdefault(c["replica"], StragglerTotals())
                totals.count += 1
                totals.wait += c["wait"]
        return dict(sorted(out.items()))
