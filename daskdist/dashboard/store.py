"""The scheduler's store of step metrics, fed by the replicas' Dask events.

Replicas ship their step timings as events on topic ``daskdist-steps``
(``{"group", "replica", "size", "steps": [StepTiming dicts]}``) and Keras
``fit``'s replica 0 ships progress on ``daskdist-progress`` (``{"tag",
"epoch", "step", "logs"}``). The scheduler plugin passes every event to
``MetricsStore.record``. Per group and replica the store keeps the last
``daskdist.metrics.history`` steps, running totals (steps, samples,
collectives, bytes) and histograms of the phase times (for Prometheus); per
group, the straggler of each collective (``stragglers.StragglerTracker``);
and the latest progress of each ``fit``; per group, its membership generations
(``membership.MembershipHistory``, recorded by the scheduler plugin, with the
client's recovery events on ``daskdist-elastic`` attached).
"""

from __future__ import annotations

import bisect
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from daskdist.dashboard.membership import ELASTIC_TOPIC, MembershipChange, MembershipHistory
from daskdist.dashboard.stragglers import StragglerTotals, StragglerTracker, collective_ranges

__all__ = ["BUCKETS", "PHASES", "GroupMetrics", "Histogram", "MetricsStore", "ReplicaMetrics"]

STEP_TOPIC = "daskdist-steps"
PROGRESS_TOPIC = "daskdist-progress"

PHASES = ("total", "input_wait", "compute", "allreduce", "apply")
BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MAX_GROUPS = 16  # groups kept (closed ones are dropped oldest first beyond this)


@dataclass
class Histogram:
    """Cumulative-able bucket counts of observed values (Prometheus-style, upper bounds ``BUCKETS``)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(upper bound, cumulative count)`` pairs, ending with ``+Inf``."""
        out, running = [], 0
        for bound, n in zip([*map(str, BUCKETS), "+Inf"], self.counts):
            running += n
            out.append((bound, running))
        return out


@dataclass
class ReplicaMetrics:
    """One replica's recent steps and running totals."""

    history: collections.deque[Any]
    steps_total: int = 0
    samples_total: int = 0
    collectives_total: int = 0
    bytes_total: int = 0
    phases: dict[str, Histogram] = field(default_factory=lambda: {p: Histogram() for p in PHASES})

    def add(self, step: dict[str, Any]) -> None:
        self.history.append(step)
        self.steps_total += 1
        self.samples_total += int(step.get("samples") or 0)
        self.collectives_total += int(step.get("collectives", 0))
        self.bytes_total += int(step.get("nbytes", 0))
        for phase, histogram in self.phases.items():
            histogram.observe(float(step.get(phase, 0.0)))

    def throughput(self) -> float:
        """Steps per second over the steps in the history (0 with fewer than two)."""
        if len(self.history) < 2:
            return 0.0
        first, last = self.history[0], self.history[-1]
        span = last["start"] + last["total"] - first["start"]
        return len(self.history) / span if span > 0 else 0.0

    def samples_per_second(self) -> float | None:
        """Steps per second times the mean samples of the steps in the history that know theirs (else None)."""
        known = [s["samples"] for s in self.history if s.get("samples") is not None]
        if not known:
            return None
        return float(self.throughput() * sum(known) / len(known))


@dataclass
class GroupMetrics:
    """What the store knows of one replica group."""

    group: str
    history: int
    replicas: dict[int, ReplicaMetrics] = field(default_factory=dict)
    closed: bool = False
    closed_at: float | None = None  # time.time() of the close, for /metrics' grace period
    updated: float = field(default_factory=time.time)
    stragglers: StragglerTracker = field(default_factory=StragglerTracker)
    membership: MembershipHistory = field(default_factory=MembershipHistory)

    @property
    def size(self) -> int:
        """Replicas in the group (as they report it; 0 before the first report)."""
        return self.stragglers.size

    def add_steps(self, rank: int, steps: list[dict[str, Any]], size: int | None = None) -> None:
        """Take a batch of one replica's steps (``size``: the group's replicas, from the event)."""
        if size:
            self.stragglers.size = max(self.stragglers.size, int(size))
        replica = self.replica(rank)
        for step in steps:
            times = step.get("collective_times") or ()
            self.stragglers.add(rank, times)
            # the history keeps, instead of every collective's time, the range of collectives the step ran
            kept = {k: v for k, v in step.items() if k != "collective_times"}
            kept["collective_ranges"] = collective_ranges(times)
            replica.add(kept)
        self.updated = time.time()

    def replica(self, rank: int) -> ReplicaMetrics:
        metrics = self.replicas.get(rank)
        if metrics is None:
            metrics = self.replicas[rank] = ReplicaMetrics(collections.deque(maxlen=self.history))
        return metrics

    def throughput(self) -> float:
        """Steps per second of the group: the slowest replica's (replicas step in lockstep)."""
        rates = [r.throughput() for r in self.replicas.values()]
        return min(rates) if rates else 0.0

    def samples_per_second(self) -> float | None:
        """Samples per second of the group: summed over the replicas that know their samples (else None)."""
        rates = [rate for r in self.replicas.values() if (rate := r.samples_per_second()) is not None]
        return sum(rates) if rates else None

    def recent_collectives(self, last: int | None = None) -> list[dict[str, Any]]:
        """The attributed collectives of the replicas' most recent ``last`` steps, oldest first.

        Each: ``{"run_id", "seq", "kind", "replica"`` (the one the others waited
        for), ``"wait"`` (seconds the earliest replica waited)``}``.
        """
        if not last:
            return self.stragglers.collectives()
        ranges = [r for steps in self.steps(last).values() for step in steps for r in step["collective_ranges"]]
        return self.stragglers.collectives(ranges)

    def straggler_summary(self, last: int | None = None) -> dict[int, StragglerTotals]:
        """Per replica, how often the collectives of the last ``last`` steps waited for it, and the wait."""
        return self.stragglers.summary(self.recent_collectives(last))

    def steps(self, last: int | None = None) -> dict[int, list[dict[str, Any]]]:
        """Per replica (rank order), its most recent ``last`` steps, oldest first.

        Once the group's membership is known, only the ranks of its newest
        generation (after a loss the highest ranks' histories are of workers
        that moved to a lower rank or left).
        """
        out = {}
        current = self.membership.replicas
        for rank in sorted(self.replicas):
            if current is not None and rank >= current:
                continue
            history = list(self.replicas[rank].history)
            out[rank] = history[-last:] if last else history
        return out


class MetricsStore:
    """Step metrics of every group on one scheduler.

    Parameters
    ----------
    history
        Steps kept per replica (``daskdist.metrics.history``), and collectives
        kept per group with their straggler.
    straggler_min_wait
        Seconds the others must wait for a replica in a collective to charge it as
        the straggler (``daskdist.metrics.straggler-min-wait``).
    """

    def __init__(self, history: int = 1000, straggler_min_wait: float = 0.001):
        self.history = int(history)
        self.straggler_min_wait = float(straggler_min_wait)
        self.groups: dict[str, GroupMetrics] = {}
        self.progress: dict[str, dict[str, Any]] = {}  # fit tag -> {"epoch", "step", "logs", "time"}

    def record(self, topic: str, msg: Any) -> None:
        """Take one event (the scheduler plugin's ``log_event`` hook); other topics are ignored."""
        if topic == STEP_TOPIC and isinstance(msg, dict):
            group = self.group(str(msg.get("group")))
            group.add_steps(int(msg.get("replica", 0)), list(msg.get("steps", ())), msg.get("size"))
        elif topic == PROGRESS_TOPIC and isinstance(msg, dict):
            self.progress[str(msg.get("tag"))] = {
                "epoch": msg.get("epoch"), "step": msg.get("step"), "logs": dict(msg.get("logs") or {}),
                "time": time.time(),
            }
            while len(self.progress) > MAX_GROUPS:
                self.progress.pop(next(iter(self.progress)))
        elif topic == ELASTIC_TOPIC and isinstance(msg, dict) and msg.get("strategy") in self.groups:
            self.groups[str(msg["strategy"])].membership.recovered(msg)

    def membership_changed(self, strategy: str, generation: int, members: list[str], before: list[str],
                           reason: str = "", replica_group: str = "", retired: list[str] | None = None
                           ) -> MembershipChange:
        """Record a generation of ``replica_group``, one of ``strategy``'s groups (the scheduler plugin calls
        this at each one, 0 included; the store's unit is the strategy, as for steps).

        A strategy first seen here does not count as reporting (``latest_group``
        keeps showing the one whose steps came last until its steps come).
        """
        new = strategy not in self.groups
        group = self.group(strategy)
        if new:
            group.updated = 0.0
        return group.membership.changed(generation, members, before, reason, group=replica_group, retired=retired)

    def group(self, group_id: str) -> GroupMetrics:
        """The metrics of ``group_id``, created on first use."""
        group = self.groups.get(group_id)
        if group is None:
            group = self.groups[group_id] = GroupMetrics(
                group_id, self.history, stragglers=StragglerTracker(self.history, self.straggler_min_wait))
            self._evict()
        return group

    def close_group(self, group_id: str) -> None:
        """Mark a group closed; its metrics stay until ``MAX_GROUPS`` newer groups push them out.

        ``/metrics`` reports a closed group for ``grace`` seconds more (``exported_groups``), the page only
        on request (``latest_group(include_closed=True)``).
        """
        group = self.groups.get(group_id)
        if group is not None and not group.closed:
            group.closed = True
            group.closed_at = time.time()

    def exported_groups(self, grace: float, now: float | None = None) -> list[GroupMetrics]:
        """The groups ``/metrics`` reports: every live one, and those closed less than ``grace`` seconds ago."""
        now = time.time() if now is None else now
        return [g for g in list(self.groups.values())
                if not g.closed or (g.closed_at is not None and now - g.closed_at < grace)]

    def latest_group(self, include_closed: bool = False) -> GroupMetrics | None:
        """The live group that reported most recently (any group with ``include_closed``), if any."""
        candidates = [g for g in list(self.groups.values()) if include_closed or not g.closed]
        return max(candidates, key=lambda g: g.updated, default=None)

    def latest_progress(self) -> dict[str, Any] | None:
        """The most recent ``fit`` progress (with its ``tag``), if any."""
        if not self.progress:
            return None
        tag, entry = max(self.progress.items(), key=lambda kv: kv[1]["time"])
        return {"tag": tag, **entry}

    def _evict(self) -> None:
        while len(self.groups) > MAX_GROUPS:
            victims = [g for g in self.groups.values() if g.closed] or list(self.groups.values())
            del self.groups[min(victims, key=lambda g: g.updated).group]
