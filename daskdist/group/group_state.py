"""What the scheduler plugin knows of each replica group: ``GroupState`` and its later ``Meeting``s."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from daskdist.exceptions import StaleGenerationError
from daskdist.group.membership import Membership, MembershipPolicy, check_generation

__all__ = ["GroupState", "Meeting"]


@dataclass
class Meeting:
    """A later meeting of a running group's replicas under one key (``exchange``)."""

    values: dict[int, Any] = field(default_factory=dict)
    fetched: set[int] = field(default_factory=set)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class GroupState:
    """What the scheduler knows of one replica group, in its current generation.

    ``workers`` are the members' addresses in rank order; ``membership``
    (when the client sent one) names their devices, hosts and roles.
    """

    group_id: str
    workers: list[str]
    client: str | None
    status: str = "starting"  # starting -> running -> failed | closed (a new generation: starting again)
    reason: str = ""
    membership: Membership | None = None
    policy: MembershipPolicy = "fixed"
    generation: int = 0
    strategy_token: str | None = None  # the key of the group's metrics in the store (the dashboard's unit)
    arrived: dict[int, str] = field(default_factory=dict)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    meetings: dict[str, Meeting] = field(default_factory=dict)
    heartbeat_timeout: float = 0.0  # elastic: a member silent this long is declared lost (0: Dask's worker-ttl)
    leave_timeout: float = 60.0  # elastic: how long a retirement waits for the member to leave at a commit
    leaving: set[str] = field(default_factory=set)  # members retiring, to leave at the next commit
    retired: set[str] = field(default_factory=set)  # members that left gracefully (not a loss)

    def wake_meetings(self) -> None:
        """The group failed, closed or moved on: every replica waiting in ``exchange`` gets an answer now."""
        for meeting in self.meetings.values():
            meeting.ready.set()

    def stale(self, generation: int | None, what: str) -> dict[str, Any] | None:
        """An error message if ``generation`` is older than the group's (``None``: a pre-generation caller)."""
        if generation is None:
            return None
        try:
            check_generation(self.group_id, self.generation, int(generation), what)
        except StaleGenerationError as e:
            return {"status": "error", "kind": "stale", "message": str(e)}
        return None
