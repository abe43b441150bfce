"""What the scheduler keeps of a group's membership changes, for the dashboard page.

The scheduler plugin records every generation of a group here
(``MetricsStore.membership_changed``: at registration, generation 0, and at
each ``change_membership``: a lost worker, an admitted one) with its time,
the members before and after and the reason; the client's recovery events
(topic ``daskdist-elastic``: ``restored`` after a loss, ``grew`` after
admitting workers) add what the recovery did (the commit it went back to, how
long it took). The page draws each change as a marker on the step chart and
the replica count over time.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ELASTIC_TOPIC", "MAX_CHANGES", "MembershipChange", "MembershipHistory", "marker_positions"]

#: The Dask event topic of the client's elastic recoveries (``daskdist.elastic.recovery`` logs them).
ELASTIC_TOPIC = "daskdist-elastic"
MAX_CHANGES = 1000  # membership changes kept per group


@dataclass
class MembershipChange:
    """One generation of a group: when it started, its members, the members before it, and why."""

    time: float
    generation: int
    members: list[str]
    before: list[str]
    reason: str = ""
    #: The replica group it happened to (a strategy may run several: the parameter-server strategy's workers).
    group: str = ""
    #: Replicas of the whole strategy after it: the members of every group of the strategy, each at its newest
    #: generation (``len(members)`` for a strategy of one group).
    replicas: int = 0
    #: Workers the group knew as retired (graceful leaves) when it happened: those gone are ``left``, not ``lost``.
    retired: list[str] = field(default_factory=list)
    #: From the client's recovery event, once it arrived: ``{"action", "commit", "seconds", "healed"}``.
    recovery: dict[str, Any] | None = None

    @property
    def lost(self) -> list[str]:
        """Members gone in this generation that did not retire (killed, crashed, cut off)."""
        return [a for a in self.before if a not in self.members and a not in self.retired]

    @property
    def left(self) -> list[str]:
        """Members gone in this generation that retired gracefully (left at a commit, nothing rolled back)."""
        return [a for a in self.before if a not in self.members and a in self.retired]

    @property
    def admitted(self) -> list[str]:
        """Members that joined in this generation (none at the group's start, generation 0)."""
        if self.generation == 0:
            return []
        return [a for a in self.members if a not in self.before]

    def to_msg(self) -> dict[str, Any]:
        """A plain dict (with ``replicas``, ``lost`` and ``admitted``), as events and the page carry it."""
        return {"time": self.time, "generation": self.generation, "replicas": len(self.members),
                "strategy_replicas": self.replicas, "members": list(self.members), "before": list(self.before), "lost": self.lost,
                "left": self.left, "admitted": self.admitted, "reason": self.reason, "recovery": self.recovery}

    def label(self) -> str:
        """A short text for the step chart: ``gen 1: 2 replicas (lost 1, admitted 0)``."""
        text = f"gen {self.generation}: {len(self.members)} replicas"
        parts = [f"lost {len(self.lost)}"] if self.lost else []
        if self.left:
            parts.append(f"left {len(self.left)}")
        if self.admitted:
            parts.append(f"admitted {len(self.admitted)}")
        if self.recovery and self.recovery.get("commit"):
            parts.append(f"from step {self.recovery['commit'][-1]}")
        return text + (f" ({', '.join(parts)})" if parts else "")


@dataclass
class MembershipHistory:
    """The generations of one group, oldest first (at most ``MAX_CHANGES``)."""

    changes: collections.deque[Any] = field(default_factory=lambda: collections.deque[Any](maxlen=MAX_CHANGES))
    #: Per replica group of the strategy, its members in its newest generation.
    current: dict[str, list[str]] = field(default_factory=dict)

    def changed(self, generation: int, members: list[str], before: list[str], reason: str = "",
                when: float | None = None, group: str = "", retired: list[str] | None = None) -> MembershipChange:
        """Record generation ``generation`` of ``group`` on ``members`` (``before``: its previous members;
        ``retired``: the workers that retired from it gracefully, so far)."""
        self.current[group] = list(members)
        change = MembershipChange(time.time() if when is None else float(when), int(generation), list(members),
                                  list(before), str(reason), group, sum(map(len, self.current.values())),
                                  sorted(retired or ()))
        self.changes.append(change)
        return change

    def recovered(self, msg: dict[str, Any]) -> None:
        """Attach a client's recovery event (``daskdist-elastic``) to the generation it names."""
        generation = msg.get("generation")
        for change in reversed(self.changes):
            if change.generation == generation:
                change.recovery = {k: msg.get(k) for k in ("action", "commit", "seconds", "healed")}
                return

    @property
    def replicas(self) -> int | None:
        """Replicas of the strategy now: its groups' members (``None`` before the first generation is recorded)."""
        return sum(map(len, self.current.values())) if self.current else None

    def changes_after_start(self) -> list[MembershipChange]:
        """Every change but the group's start (generation 0): what the step chart marks."""
        return [c for c in self.changes if c.generation > 0]

    def series(self, now: float | None = None) -> dict[str, list[Any]]:
        """The replica count over time: one point per generation, and one at ``now`` (the count still holds).

        Columns: ``time`` (ms since the epoch, as Bokeh's datetime axes take it),
        ``replicas``, ``generation``, ``lost``, ``admitted``, ``reason`` (text).
        """
        out: dict[str, list[Any]] = {k: [] for k in ("time", "replicas", "generation", "lost", "admitted", "reason")}
        points = list(self.changes)
        for change in points:
            out["time"].append(change.time * 1000)
            out["replicas"].append(change.replicas)
            out["generation"].append(change.generation)
            out["lost"].append(", ".join(change.lost + [f"{a} (retired)" for a in change.left]))
            out["admitted"].append(", ".join(change.admitted))
            out["reason"].append(change.reason)
        if points:
            last = points[-1]
            out["time"].append(max(time.time() if now is None else now, last.time) * 1000)
            out["replicas"].append(last.replicas)
            out["generation"].append(last.generation)
            out["lost"].append("")
            out["admitted"].append("")
            out["reason"].append("(now)")
        return out


def marker_positions(starts: list[float], changes: list[MembershipChange]) -> list[tuple[float, MembershipChange]]:
    """Where each change goes on the step chart: before the first shown step that started after it.

    ``starts`` are the wall-clock starts of the steps shown (oldest first; bar
    group ``i`` spans ``[i, i + 1)``). A change after every shown step goes at
    the right edge; one before every shown step is out of view and left out.
    Each position is ``i - 0.05``: in the gap before bar group ``i``.
    """
    out = []
    for change in changes:
        index = next((i for i, start in enumerate(starts) if start >= change.time), len(starts))
        if index == 0:
            continue  # older than every step shown (or no steps shown)
        out.append((index - 0.05, change))
    return out
