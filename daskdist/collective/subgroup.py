"""What a subgroup's communicator runs over: its members' share of the root group's transport and control.

A subgroup (``ProcessGroup.new_group``) reaches its members through the
transport of the generation's root group, with its own tag space: the
second tag field (the collective's number) carries the subgroup's code in
its high bits (``SEQ_BITS``), so the root group's numbers, each subgroup's
numbers and the point-to-point messages (``P2P_SEQ``) never meet. The
first tag field stays the attempt, so aborts, stale-message drops and deadlines
work as in the root group: an abort in any group of a generation aborts the
current attempt for every group of that generation.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from daskdist.collective.mailbox import Abort, Tag
from daskdist.collective.transport.base import Combine, SendHandle, Transport

__all__ = ["P2P_SEQ", "SEQ_BITS", "SubgroupControl", "SubgroupTransport", "subgroup_code"]

#: Low bits of a tag's second field that number a group's collectives; the bits above name the subgroup.
SEQ_BITS = 36
#: The collective number that marks point-to-point messages (never reached by a group's collectives).
P2P_SEQ = (1 << SEQ_BITS) - 1
_CODE_BITS = 24  # 24 + 36 bits: the tag field stays a positive int64 (the shared-memory and socket headers)


def subgroup_code(path: tuple[int, ...]) -> int:
    """The code of the subgroup at ``path`` (indices of ``new_group`` calls from the root); the root is 0."""
    if not path:
        return 0
    return zlib.crc32(repr(path).encode()) % ((1 << _CODE_BITS) - 1) + 1


class SubgroupTransport(Transport):
    """The root transport, seen by a subgroup: subgroup ranks, its own tag space.

    Parameters
    ----------
    root
        The root group's transport.
    members
        The root rank of each subgroup rank.
    code
        ``subgroup_code`` of the subgroup.
    """

    name = "subgroup"

    def __init__(self, root: Transport, members: Sequence[int], code: int):
        super().__init__(list(members).index(root.rank), [root.addresses[r] for r in members], root.mailbox)
        self._root = root
        self._members = list(members)
        self._offset = code << SEQ_BITS

    def _tag(self, tag: Tag) -> Tag:
        return (tag[0], tag[1] | self._offset, *tag[2:])

    def send(self, dst: int, tag: Tag, payload: Any) -> SendHandle:
        return self._root.send(self._members[dst], self._tag(tag), payload)

    def send_many(self, dst: int, messages: Sequence[tuple[Tag, Any]]) -> list[SendHandle]:
        return self._root.send_many(self._members[dst], [(self._tag(tag), payload) for tag, payload in messages])

    def recv(self, src: int, tag: Tag, deadline: float) -> Any:
        return self._root.recv(self._members[src], self._tag(tag), deadline)

    def recv_into(self, src: int, tag: Tag, deadline: float, out: Any, combine: Combine | None,
                  base: Any = None) -> None:
        self._root.recv_into(self._members[src], self._tag(tag), deadline, out, combine, base)

    def sendrecv(self, dst: int, send_tag: Tag, payload: Any, src: int, recv_tag: Tag, deadline: float, out: Any,
                 combine: Combine | None, base: Any = None) -> None:
        self._root.sendrecv(self._members[dst], self._tag(send_tag), payload, self._members[src],
                            self._tag(recv_tag), deadline, out, combine, base)

    def routes_by_peer(self) -> dict[int, Transport]:
        """Nothing: a subgroup never takes the root's shared-memory lane or single-copy engine."""
        return {}


class SubgroupControl:
    """The root group's control plane, seen by a subgroup.

    Aborts go to every member of the root group (the attempt is the
    generation's); probes ask the member where it is and report its number
    in this subgroup (the ``groups`` of its status, keyed by code).
    """

    def __init__(self, root: Any, members: Sequence[int], code: int):
        self._root = root
        self._members = list(members)
        self._key = str(code)

    def abort_peers(self, attempt: int, abort: Abort) -> None:
        self._root.abort_peers(attempt, abort)

    def probe(self, rank: int, timeout: float) -> dict[str, Any] | None:
        status: dict[str, Any] | None = self._root.probe(self._members[rank], timeout)
        if status is None:
            return None
        return {**status, "collective": (status.get("groups") or {}).get(self._key, 0)}

    def exchange(self, key: str, value: Any, deadline: float, attempt: int) -> dict[int, Any]:
        raise NotImplementedError("subgroups do not meet at the scheduler (no NCCL communicator of their own)")
