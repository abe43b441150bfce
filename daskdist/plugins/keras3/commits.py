"""A Keras 3 elastic epoch's commits on one replica, kept off the step's path.

At a commit (every ``commit_every`` steps) the replica takes on the step's
path only what the next step's forward changes before its apply (the random
generators' states, the moving statistics, the local metric variables: a few
small arrays, ``KerasTrainable.begin_snapshot``); a thread copies the rest
(weights and the optimizer's slots, into the arrays of the commit the ring
let go, ``Commit.copying``) while the next step's input, forward and backward
run, and the replica waits for it just before that step's apply (the
exchange returns only once the copy is done: ``CommitRing.settle``).

The commit's metric totals (each metric variable summed over the replicas,
so a replica lost later still counts) and the two flags of a commit boundary
(free workers wait, members retire: ``elastic.boundary``) travel with a
step's own gradient all-reduce (the SPMD driver's ``sums``) instead of a
second all-reduce: the flags with the step that ends at the commit, the
totals with the next step's. So a commit enters the ring only once its totals
are summed: a replica lost in the next step's exchange leaves every survivor
at the commit before (the ring holds two), and "the newest commit all
survivors hold" stays right. When the flags stop the epoch at a commit, its
totals are summed there and then (one all-reduce, at a membership change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from daskdist import context, fault_points
from daskdist.elastic.boundary import FreeWorkerWatch, StopAtCommit, boundary_flags
from daskdist.elastic.replica import Commit, CommitKey, commit_ring
from daskdist.group.service import MODEL, ReplicaService
from daskdist.ops import ReduceOp
from daskdist.strategy.training_contract import GradientExchange, SpmdStepDriver, StepDriver

__all__ = ["KerasCommits"]


class KerasCommits:
    """The commits of one elastic epoch command of one replica (``commands.elastic_train_epoch``).

    Parameters
    ----------
    service
        The replica.
    model_id
        The model's resident id.
    resident
        Its ``KerasTrainable``.
    driver
        The step driver: the SPMD driver carries the commit's sums in its all-reduce; with another (or a step
        that exchanged nothing) they are summed by an all-reduce of their own.
    watch
        Replica 0's look for free workers.
    """

    def __init__(self, service: ReplicaService, model_id: str, resident: Any, driver: StepDriver,
                 watch: FreeWorkerWatch):
        self.service, self.key, self.resident, self.watch = service, (MODEL, model_id), resident, watch
        self.ring = commit_ring(service)
        self.carrying = isinstance(driver, SpmdStepDriver)
        self.pending: tuple[Commit, list[np.ndarray]] | None = None  # copied, its totals not yet summed
        self.carry: list[float] = []  # what this step's exchange adds to the driver's sums
        self.at_commit = False
        self.own = 0  # the sums the trainable itself passed (the carried ones follow them)
        self.exchanged = False

    def totals_at(self, key: CommitKey) -> list[np.ndarray] | None:
        """The metric totals commit ``key`` holds (``None``: this replica holds no such commit)."""
        try:
            state = self.ring.get(key).state.get(self.key, {})
        except KeyError:
            return None
        metrics = state.get("metrics")
        return list(metrics) if metrics is not None else None

    # -- the step ----------------------------------------------------------------------

    def before_step(self, at_commit: bool) -> None:
        """Before a step: what its exchange carries (the pending commit's totals; ``at_commit``: the flags)."""
        self.at_commit = at_commit
        carry: list[float] = []
        if self.pending is not None:
            carry += _flat(self.pending[1])
        if at_commit:
            carry += boundary_flags(self.service, self.watch).tolist()
        self.carry = carry
        self.exchanged = False

    def exchange(self, inner: GradientExchange) -> GradientExchange:
        """``inner`` with the carried sums added, returning only once the commit being copied is copied."""

        def exchanged(gradients: Sequence[Any], rows: int, sums: Sequence[float] = (),
                      summed: bool = False) -> list[Any] | None:
            self.own = len(sums)
            carried = (*sums, *self.carry) if self.carrying else tuple(sums)
            reduced = inner(gradients, rows, carried, summed)
            self.exchanged = True
            self.ring.settle()  # the optimizer's apply changes what the copy reads
            return reduced

        return exchanged

    def after_step(self, key: CommitKey) -> None:
        """After a step: the pending commit enters the ring with its totals; at a commit, the next one is taken.

        Raises ``StopAtCommit`` when free workers wait or members retire (every replica learns the same).
        """
        summed = self._summed()
        if self.pending is not None:
            commit, own = self.pending
            self.pending = None
            self._enter(commit, _unflat(summed[:_size(own)], own))
            summed = summed[_size(own):]
        if not self.at_commit:
            return
        grow, leave = (float(f) > 0 for f in summed[-2:])
        own = self.resident.local_metric_totals()
        pause = fault_points.bound("commit") if fault_points.ARMED else None  # a test's fault point, in the copy
        commit = Commit.copying((key[0], key[1], key[2]), self.service.objects, {}, pause, reuse=self.ring.take_spare())
        if grow or leave:  # a membership change at this commit: its totals summed now, then every replica stops
            self._enter(commit, _all_reduce(own))
            raise StopAtCommit(key[2], leave)
        self.pending = (commit, own)

    def finish(self) -> None:
        """At the command's end (or a loss): a commit whose totals no step carried is dropped (a newer one, the
        epoch's end, follows); no copy goes on past the command."""
        self.pending = None
        self.ring.settle()

    # -- helpers ---------------------------------------------------------------------

    def _summed(self) -> list[float]:
        """This step's carried values summed over the replicas."""
        if not self.carry:
            return []
        totals = getattr(self.resident, "step_totals", None)
        if self.carrying and self.exchanged and totals is not None:
            return [float(v) for v in totals.sums[self.own:self.own + len(self.carry)]]
        # no exchange carried them (another driver, or a step without trainable weights): one all-reduce here
        self.ring.settle()
        return [float(v) for v in _all_reduce([np.asarray(self.carry, np.float64)])[0]]

    def _enter(self, commit: Commit, totals: list[np.ndarray]) -> None:
        """``commit`` with its summed metric totals, into the ring (its copy done first)."""
        commit.settle()
        state = commit.state.get(self.key)
        if state is not None:
            state["metrics"] = totals
        self.resident.keep_metric_totals(totals)
        self.ring.add(commit)


def _flat(arrays: list[np.ndarray]) -> list[float]:
    return [float(v) for a in arrays for v in np.asarray(a, np.float64).ravel()]


def _size(arrays: list[np.ndarray]) -> int:
    return sum(int(np.asarray(a).size) for a in arrays)


def _unflat(values: Sequence[float], like: list[np.ndarray]) -> list[np.ndarray]:
    out, at = [], 0
    for a in like:
        a = np.asarray(a)
        out.append(np.asarray(values[at:at + a.size], a.dtype).reshape(a.shape))
        at += a.size
    return out


def _all_reduce(arrays: list[np.ndarray]) -> list[np.ndarray]:
    ctx = context.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1 or not arrays:
        return [np.asarray(a) for a in arrays]
    return [np.asarray(t) for t in ctx.all_reduce(ReduceOp.SUM, arrays)]
