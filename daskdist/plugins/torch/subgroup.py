"""Collectives of a subgroup (``dist.new_group(ranks)``) over point-to-point messages between its members.

Until the process-group layer offers subgroups of its own, a subgroup's
collective gathers at its first member, which combines and sends the result
back: correct for every supported operation, and meant for the small
collectives subgroups carry (DeviceMesh dimensions, SyncBatchNorm groups);
the whole group's collectives keep daskdist's engines.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import numpy as np

from daskdist.ops import ReduceOp
from daskdist.plugins.torch.comm import ReplicaComm

__all__ = ["SubgroupComm"]

_COMBINE = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
            ReduceOp.PRODUCT: np.multiply}


class SubgroupComm:
    """The collectives of the members ``ranks`` (global ranks) of the replica group, for ``ProcessGroupDaskdist``."""

    def __init__(self, comm: ReplicaComm, ranks: list[int]):
        self.comm = comm
        self.ranks = list(ranks)
        self.me = comm.runtime.rank
        self.leader = self.ranks[0]
        self.tag = "g" + hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:24]

    def _gather(self, arrays: list[np.ndarray]) -> list[list[np.ndarray]] | None:
        """Every member's arrays at the leader (member order); ``None`` elsewhere."""
        if self.me != self.leader:
            self.comm.send_object([np.ascontiguousarray(a) for a in arrays], self.leader, self.tag)
            return None
        return [[np.array(a) for a in arrays] if r == self.me else self.comm.recv_object(r, self.tag)
                for r in self.ranks]

    def _share(self, value: Any) -> Any:
        """The leader's ``value`` on every member."""
        if self.me == self.leader:
            for r in self.ranks[1:]:
                self.comm.send_object(value, r, self.tag)
            return value
        return self.comm.recv_object(self.leader, self.tag)

    def all_reduce(self, op: ReduceOp, arrays: list[np.ndarray]) -> list[np.ndarray]:
        everyone = self._gather(arrays)
        result = None
        if everyone is not None:
            _check_same(everyone, self.ranks, "all_reduce")
            combine = _COMBINE[op]
            result = [np.array(parts[0]) for parts in zip(*everyone)]
            for member in everyone[1:]:
                for acc, a in zip(result, member):
                    combine(acc, a, out=acc)
            if op is ReduceOp.MEAN:
                result = [(acc / len(self.ranks)).astype(acc.dtype) for acc in result]
        return list(self._share(result))

    def broadcast(self, arrays: list[np.ndarray], root: int) -> list[np.ndarray]:
        source = self.ranks[root]
        if self.me == source:
            for r in self.ranks:
                if r != source:
                    self.comm.send_object([np.ascontiguousarray(a) for a in arrays], r, self.tag)
            return list(arrays)
        return list(self.comm.recv_object(source, self.tag))

    def all_gather(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        everyone = self._gather(arrays)
        result = None
        if everyone is not None:
            result = [np.concatenate(parts) for parts in zip(*everyone)]
        return list(self._share(result))

    def reduce_scatter(self, op: ReduceOp, arrays: list[np.ndarray]) -> list[np.ndarray]:
        reduced = self.all_reduce(op, arrays)
        index = self.ranks.index(self.me)
        return [np.array_split(r, len(self.ranks))[index] for r in reduced]

    def all_gather_objects(self, obj: Any) -> list[Any]:
        everyone = self._gather([np.frombuffer(pickle.dumps(obj), dtype=np.uint8)])
        result = None if everyone is None else [pickle.loads(parts[0].tobytes()) for parts in everyone]
        return list(self._share(result))

    def barrier(self) -> None:
        self.all_reduce(ReduceOp.SUM, [np.zeros(1, dtype=np.int8)])


def _check_same(everyone: list[list[np.ndarray]], ranks: list[int], what: str) -> None:
    first = [(a.shape, a.dtype) for a in everyone[0]]
    for rank, member in zip(ranks[1:], everyone[1:]):
        got = [(a.shape, a.dtype) for a in member]
        if got != first:
            raise ValueError(f"{what}: rank {ranks[0]} has {_describe(first)} but rank {rank} has {_describe(got)}")


def _describe(specs: list[tuple[Any, Any]]) -> str:
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in specs)
