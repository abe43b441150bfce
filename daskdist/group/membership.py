"""Who is in a replica group, and in which generation: the bottom of the group layer.

A group's membership changes (a member is lost, retired or added) only by
moving to a new **generation**. Everything built from a membership (the
transports, the communicator, shared-memory segment names, the latency lane's
channels) belongs to one generation and is rebuilt for the next; the values
the replicas hold (variables, models, dataset shards) outlive it. Every
message between the client, the scheduler plugin and the replicas carries
``(group_id, generation, run_id)``; one of an older generation is rejected
with ``StaleGenerationError`` and never consumed, as Dask's P2P shuffle
rejects stale run ids (``_ShuffleRunManager.get_with_run_id``).

This module imports nothing from daskdist but ``exceptions``: every layer may
import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NewType

from daskdist.exceptions import StaleGenerationError

__all__ = [
    "ROLES",
    "Generation",
    "GroupId",
    "Member",
    "Membership",
    "MembershipPolicy",
    "Rank",
    "Role",
    "RunId",
    "SchedulerView",
    "check_generation",
]

#: A replica group's id (``"daskdist-<hex>"``), unique per cluster.
GroupId = NewType("GroupId", str)
#: A membership generation of a group: 0 at launch, one more at each membership change.
Generation = NewType("Generation", int)
#: A member's position in its generation's membership (replica id in sync, for SPMD strategies).
Rank = NewType("Rank", int)
#: One command sent by the client, numbered per group.
RunId = NewType("RunId", int)

Role = Literal["replica", "ps", "worker", "chief"]
#: ``replica``: a member of an SPMD strategy; ``ps`` and ``worker``: parameter-server roles;
#: ``chief``: the coordinator (the client, in daskdist).
ROLES: tuple[str, ...] = ("replica", "ps", "worker", "chief")

MembershipPolicy = Literal["fixed", "elastic"]


@dataclass(frozen=True)
class Member:
    """One member of a group: the Dask worker it runs on, its device, its host and its role.

    Parameters
    ----------
    address
        The Dask worker's address.
    device
        The TF device string of the member (``"/job:localhost/replica:0/task:0/device:CPU:0"``).
    host
        The host as transports see it (``daskdist.collective.hosts``).
    role
        One of ``ROLES``.
    """

    address: str
    device: str
    host: str
    role: Role = "replica"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Unknown member role {self.role!r}; expected one of {', '.join(ROLES)}")


@dataclass(frozen=True)
class Membership:
    """The members of a group in one generation; a member's rank is its position.

    Parameters
    ----------
    group_id
        The group.
    generation
        Which generation this is (0 at launch).
    members
        The members in rank order.
    """

    group_id: GroupId
    generation: Generation
    members: tuple[Member, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def addresses(self) -> list[str]:
        return [m.address for m in self.members]

    @property
    def devices(self) -> list[str]:
        return [m.device for m in self.members]

    @property
    def hosts(self) -> list[str]:
        return [m.host for m in self.members]

    @property
    def wire_id(self) -> str:
        """The group and generation in one token, for what peers of one generation share.

        Transports name their shared-memory segments and greet their TCP
        peers with it, so nothing of an older generation is ever read by a newer one.
        """
        return f"{self.group_id}g{self.generation}"

    def ranks(self, role: str | None = None) -> list[Rank]:
        """The ranks of the members with ``role`` (every member for ``None``)."""
        return [Rank(r) for r, m in enumerate(self.members) if role is None or m.role == role]

    def rank_of(self, address: str) -> Rank:
        """The rank of the member on worker ``address``; ``ValueError`` if none."""
        for rank, member in enumerate(self.members):
            if member.address == address:
                return Rank(rank)
        raise ValueError(f"worker {address} is not a member of {self.group_id} generation {self.generation}")

    def next(self, members: tuple[Member, ...] | list[Member]) -> Membership:
        """The membership of the next generation, with ``members``."""
        return Membership(self.group_id, Generation(self.generation + 1), tuple(members))

    def to_msg(self) -> dict[str, Any]:
        """A msgpack-able form (for the scheduler's handlers)."""
        return {
            "group_id": self.group_id,
            "generation": self.generation,
            "members": [[m.address, m.device, m.host, m.role] for m in self.members],
        }

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> Membership:
        members = tuple(Member(str(a), str(d), str(h), r) for a, d, h, r in msg["members"])
        return cls(GroupId(msg["group_id"]), Generation(int(msg["generation"])), members)


@dataclass(frozen=True)
class SchedulerView:
    """What the scheduler plugin knows of a group now (``ReplicaGroup.scheduler_view``).

    Attributes
    ----------
    membership
        The group's current membership (possibly newer than the client's).
    retired
        Members that left gracefully (retired) in any generation, by address.
    """

    membership: Membership
    retired: frozenset[str]

    def departed(self, before: list[str]) -> list[str]:
        """Those of ``before`` that are no longer members."""
        now = set(self.membership.addresses)
        return [a for a in before if a not in now]


def check_generation(group_id: str, current: int, received: int, what: str) -> None:
    """Reject a message of an older generation than ``current``.

    Raises
    ------
    StaleGenerationError
        ``received < current``: the message was made for a membership that no longer exists.
    """
    if received < current:
        raise StaleGenerationError(
            f"{what} of {group_id} carries generation {received}, but the group is at generation {current}: "
            "it was made for an earlier membership and is rejected, not consumed",
            group_id=group_id, received=received, current=current,
        )
