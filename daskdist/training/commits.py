"""An elastic epoch's commits on one replica, kept off the step's path (every adapter's model).

At a commit (every ``commit_every`` steps) the replica takes on the step's
path only what the next step's forward changes before its apply (the random
generators' states, the moving statistics, the local metric variables: a few
small arrays, the resident's ``step_state``). Where a commit copies the
state, a thread copies the rest (weights and the optimizer's slots,
``Commit.copying``, with the resident's ``begin_snapshot`` if it has one) while the next
step's input, forward and backward run, and the replica waits for it just
before that step's apply (the exchange returns only once the copy is done:
``CommitRing.settle``).

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

Even off the step's path, a copy of the weights and Adam's slots costs the
next step its memory traffic (measured: 1-2 ms of a 21 ms step for the
tutorial's CNN, whichever thread copies). So only one commit in
``daskdist.elastic.replayed-commits`` copies the state; the commits between
are ``ReplayedCommit``: the full commit before them and the reduced
gradients of the steps since (the all-reduce's own output arrays, kept, not
copied), with what each step's forward changed (random states, moving
statistics) and the metric totals. Gone back to (a restore, a newcomer's
copy), such a commit is rebuilt: the full commit restored, its steps'
gradients applied again by the optimizer (the same arithmetic on the same
arrays, so every replica rebuilds the same bits), the forward's state put
back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from dask.utils import parse_bytes

from daskdist import config, context, fault_points
from daskdist.elastic.boundary import FreeWorkerWatch, StopAtCommit, boundary_flags
from daskdist.elastic.replica import Commit, CommitKey, ResidentStates, commit_ring
from daskdist.group.service import MODEL, ReplicaService, ResidentStore
from daskdist.ops import ReduceOp
from daskdist.strategy.drivers.contract import GradientExchange, SpmdStepDriver, StepDriver

__all__ = ["Commits", "ReplayedCommit"]

logger = logging.getLogger(__name__)


class ReplayedCommit(Commit):
    """A commit kept as the full commit before it and the reduced gradients of the steps since (see module).

    Parameters
    ----------
    key
        Its ``(fit, epoch, step)``.
    base
        The full commit (``Commit``) its steps start from.
    gradients
        The reduced gradients of each step since ``base``, in order (arrays nothing writes any more).
    forward
        The resident's ``step_state()`` at this commit (random states, moving statistics).
    objects, model_key, learning_rate
        The replica's residents, the model's key among them, the learning rate its steps applied with.
    """

    def __init__(self, key: CommitKey, base: Commit, gradients: list[list[np.ndarray]], forward: dict[str, Any],
                 objects: ResidentStore, model_key: tuple[str, str], learning_rate: float | None):
        super().__init__(key, {}, {})
        self._state = None
        self.base, self.gradients, self.forward = base, gradients, forward
        self.objects, self.model_key, self.learning_rate = objects, model_key, learning_rate
        self.metrics: list[np.ndarray] = []

    @property
    def state(self) -> ResidentStates:
        """The full state, rebuilt once (it leaves this replica's residents at this commit: only read it where
        they go back to it next, as every caller does: a restore, a newcomer's copy from a restored member)."""
        if self._state is None:
            self._state = self._rebuild()
        return self._state

    @property
    def copied(self) -> bool:
        return self.base.copied

    @property
    def settled(self) -> bool:
        return self.base.settled

    @property
    def rebuilt(self) -> bool:
        """Whether the full state was rebuilt (``state`` then costs nothing and changes nothing)."""
        return self._state is not None

    def settle(self) -> None:
        self.base.settle()

    def resident_keys(self) -> list[tuple[str, str]]:
        return self.base.resident_keys()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return Commit, (self.key, self.state, self.progress)  # another replica gets the full state

    def _rebuild(self) -> ResidentStates:
        base = self.base.state
        self.objects.restore(base)
        resident = self.objects.get(*self.model_key)
        resident.replay(self.gradients, self.learning_rate)
        model = resident.replayed_snapshot(self.forward, self.metrics)
        state = {**base, self.model_key: model}
        self.objects.restore({self.model_key: model})  # the residents at this commit, forward's state included
        return state


class Commits:
    """The commits of one elastic epoch command of one replica (``training.elastic.elastic_train_epoch``).

    Parameters
    ----------
    service
        The replica.
    model_id
        The model's resident id.
    resident
        Its resident (``training.elastic.ElasticReplicaModel``).
    driver
        The step driver: the SPMD driver carries the commit's sums in its all-reduce; with another (or a step
        that exchanged nothing) they are summed by an all-reduce of their own.
    watch
        Replica 0's look for free workers.
    """

    def __init__(self, service: ReplicaService, model_id: str, resident: Any, driver: StepDriver,
                 watch: FreeWorkerWatch, start: CommitKey, learning_rate: float | None):
        self.service, self.key, self.resident, self.watch = service, (MODEL, model_id), resident, watch
        self.ring = commit_ring(service)
        self.carrying = isinstance(driver, SpmdStepDriver)
        self.learning_rate = learning_rate
        self.every = max(1, int(config.get("elastic.replayed-commits", 16)))
        self.most_bytes = parse_bytes(str(config.get("elastic.replayed-bytes", "256MiB")))
        self.log_bytes = 0  # the kept gradients' bytes: a full copy is taken before they pass ``most_bytes``
        # the full commit the coming commits are replayed from, and the reduced gradients of the steps since it
        self.base: Commit | None = None
        self.log: list[list[np.ndarray]] = []
        self.logging = True  # every step's reduced gradients came back (a driver that assigns: copy every commit)
        self.since = 0  # commits since the base
        # the commit the command starts from: its state is the residents' now (an epoch goes on from the newest
        # commit; a new epoch from the last one's end)
        newest = next(reversed(self.ring.commits.values()), None)
        begun = None
        if newest is not None and (newest.key == tuple(start) or (
                start[2] == 0 and newest.key[0] == start[0] and newest.key[1] == start[1] - 1)):
            begun = newest
        if isinstance(begun, ReplayedCommit) and not begun.rebuilt:
            self.base, self.log = begun.base, list(begun.gradients)
            self.log_bytes = sum(int(getattr(g, "nbytes", 0)) for step in self.log for g in step)
        elif begun is not None:
            self.base = begun
        self.pending: _Pending | None = None  # copied, its totals not yet summed
        self.carry: list[float] = []  # what this step's exchange adds to the driver's sums
        self.at_commit = False
        self.own = 0  # the sums the trainable itself passed (the carried ones follow them)
        self.exchanged = False
        self.alone: bool | None = None  # one replica in sync (read at the first exchange: fixed for the command)
        self.copying: Commit | None = None  # the full commit whose copy may still run (waited for at an exchange)
        self._wrapped: tuple[GradientExchange, GradientExchange] | None = None  # the last ``exchange``'s answer

    def totals_at(self, key: CommitKey) -> list[np.ndarray] | None:
        """The metric totals commit ``key`` holds (``None``: this replica holds no such commit)."""
        try:
            commit = self.ring.get(key)
        except KeyError:
            return None
        if isinstance(commit, ReplayedCommit) and not commit.rebuilt:
            return list(commit.metrics)
        state = commit.state.get(self.key, {})
        metrics = state.get("metrics")
        return list(metrics) if metrics is not None else None

    # -- the step ----------------------------------------------------------------------

    def before_step(self, at_commit: bool) -> None:
        """Before a step: what its exchange carries (the pending commit's totals; ``at_commit``: the flags)."""
        self.at_commit = at_commit
        carry = self.pending.flat if self.pending is not None else []
        if at_commit:
            carry = carry + boundary_flags(self.service, self.watch)
        self.carry = carry
        self.exchanged = False

    def exchange(self, inner: GradientExchange) -> GradientExchange:
        """``inner`` with the carried sums added, returning only once the commit being copied is copied (the same
        function for the same ``inner``: a step's driver hands its exchange to every step)."""
        wrapped = self._wrapped
        if wrapped is not None and wrapped[0] == inner:
            return wrapped[1]

        def exchanged(gradients: Sequence[Any], rows: int, sums: Sequence[float] = (),
                      summed: bool = False) -> list[Any] | None:
            self.own = len(sums)
            carried = (*sums, *self.carry) if self.carrying else tuple(sums)
            reduced = inner(gradients, rows, carried, summed)
            self.exchanged = True
            if reduced is None:
                self.logging = False
            elif self.base is not None:
                if self.alone is None:
                    ctx = context.get_replica_context()
                    self.alone = ctx is None or ctx.num_replicas_in_sync == 1
                # alone, they are the local gradients (the optimizer's input, written again): copied
                kept = [np.array(g, copy=True) for g in reduced] if self.alone else list(reduced)
                self.log.append(kept)
                self.log_bytes += sum(int(getattr(g, "nbytes", 0)) for g in kept)
            self._settle()  # the optimizer's apply changes what the copies read
            return reduced

        self._wrapped = (inner, exchanged)
        return exchanged

    def after_step(self, key: CommitKey) -> None:
        """After a step: the pending commit enters the ring with its totals; at a commit, the next one is taken.

        Raises ``StopAtCommit`` when free workers wait or members retire (every replica learns the same).
        """
        pending = self.pending
        if pending is None and not self.at_commit:
            return
        summed = self._summed()
        if pending is not None:
            self.pending = None
            size = len(pending.flat)
            self._enter(pending.commit, pending.unflat(summed[:size]))
            summed = summed[size:]
        if not self.at_commit:
            return
        grow, leave = summed[-2] > 0, summed[-1] > 0
        own = self.resident.local_metric_totals()
        key = (key[0], key[1], key[2])
        self.since += 1
        taken: Commit
        if self.base is not None and self.logging and self.since < self.every and self.log_bytes <= self.most_bytes:
            taken = ReplayedCommit(key, self.base, list(self.log), self.resident.step_state(), self.service.objects,
                                    self.key, self.learning_rate)
        else:
            pause = fault_points.bound("commit") if fault_points.ARMED else None  # a test's fault point, in the copy
            taken = self.copying = Commit.copying(key, self.service.objects, {}, pause, self.ring.copier)
            self.base, self.log, self.since, self.log_bytes = taken, [], 0, 0
        if grow or leave:  # a membership change at this commit: its totals summed now, then every replica stops
            self._enter(taken, _all_reduce(own))
            raise StopAtCommit(key[2], leave)
        self.pending = _Pending(taken, own)

    def finish(self) -> None:
        """At the command's end (or a loss): a commit whose totals no step carried is dropped (a newer one, the
        epoch's end, follows); no copy goes on past the command."""
        pending, self.pending, self.copying = self.pending, None, None
        self._wrapped = None  # (its function holds these commits: no cycle left for the garbage collector)
        if pending is not None:
            try:
                pending.commit.settle()
            except Exception as e:  # noqa: BLE001 - the commit is dropped, and what its copy raised with it
                logger.debug("The copy of a dropped commit %s failed: %r", pending.commit.key, e)
        self.ring.settle()

    # -- helpers ---------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait until every copy is done: the ring's commits' and the pending commit's (not in the ring until
        the next step has summed its totals, its copy may still run while that step's apply is due). Only a full
        commit copies: once its copy is waited for, the replayed commits on it wait for nothing."""
        if self.copying is not None:
            self.copying.settle()
            self.copying = None
        self.ring.settle()

    def _summed(self) -> list[float]:
        """This step's carried values summed over the replicas."""
        if not self.carry:
            return []
        totals = getattr(self.resident, "step_totals", None)
        if self.carrying and self.exchanged and totals is not None:
            return list(totals.sums[self.own:self.own + len(self.carry)])  # the driver's floats
        # no exchange carried them (another driver, or a step without trainable weights): one all-reduce here
        self._settle()
        return [float(v) for v in _all_reduce([np.asarray(self.carry, np.float64)])[0]]

    def _enter(self, commit: Commit, totals: list[np.ndarray]) -> None:
        """``commit`` with its summed metric totals, into the ring (its copy done first)."""
        commit.settle()
        if isinstance(commit, ReplayedCommit):
            commit.metrics = totals
        else:
            state = commit.state.get(self.key)
            if state is not None:
                state["metrics"] = totals
        self.resident.keep_metric_totals(totals)
        self.ring.add(commit)


class _Pending:
    """A commit taken, its totals not yet summed: this replica's totals (``own``), flat as the exchange carries them.

    The flat values are float64 (Python floats); ``unflat`` gives the summed values back in ``own``'s shapes and
    dtypes.
    """

    __slots__ = ("commit", "flat", "layout")

    def __init__(self, commit: Commit, own: list[np.ndarray]):
        self.commit = commit
        self.flat: list[float] = []
        self.layout: list[tuple[int, int, np.dtype[Any], tuple[int, ...]]] = []
        for array in own:
            array = np.asarray(array)
            start = len(self.flat)
            self.flat += array.astype(np.float64, copy=False).ravel().tolist()
            self.layout.append((start, len(self.flat), array.dtype, array.shape))

    def unflat(self, values: Sequence[float]) -> list[np.ndarray]:
        return [np.array(values[start:stop], dtype).reshape(shape) for start, stop, dtype, shape in self.layout]


def _all_reduce(arrays: list[np.ndarray]) -> list[np.ndarray]:
    ctx = context.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1 or not arrays:
        return [np.asarray(a) for a in arrays]
    return [np.asarray(t) for t in ctx.all_reduce(ReduceOp.SUM, arrays)]
