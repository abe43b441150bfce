"""``fit`` on an elastic strategy: epochs in committed steps, recovered from the newest commit after a loss.

Client side (``keras.Model.fit`` hands its epochs here when the strategy has
``ElasticOptions``). Each epoch is one command, as without elasticity; the
replicas commit every ``commit_every`` steps (``elastic/replica.py``). When
a member is lost the command fails; the group is recovered
(``elastic/recovery.py``) at the newest commit all survivors hold, the rest
of the epoch (its rows after that commit, in the epoch's order: source order
or the seeded permutation standing for a shuffle, ``elastic/epochs.py``) is
planned again over the new members with the input planner (the global batch
stays the same size, re-split over the replica count, unless
``keep="per_replica"``), and the epoch goes on from there. The ledger records
the rows of every committed step.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from daskdist.data.dataset import Dataset
from daskdist.elastic.epochs import EpochInput, EpochPlans
from daskdist.elastic.ledger import DataLedger
from daskdist.elastic.options import ElasticOptions, notify_membership_change
from daskdist.elastic.recovery import (
    RECOVERABLE,
    Recovery,
    grow,
    leave,
    recover_within_budget,
    refill,
    reform_before_commit,
    remember_members,
)
from daskdist.elastic.replica import CommitKey, commit_keys, commit_progress, elastic_train_epoch, take_commit

if TYPE_CHECKING:
    from daskdist.keras.models import Model

__all__ = ["ElasticFit", "EpochRunner", "catch_up", "prepare_members"]

logger = logging.getLogger(__name__)

_FITS = itertools.count(1)


class EpochRunner(Protocol):
    """What an elastic fit needs of the model's epoch runner (``daskdist.keras.models``)."""

    model: Model
    train: Dataset  # the fit's training data
    dist_train: Any  # ``train`` distributed over the replicas (its ``element_spec``)
    tag: str  # the fit's progress events carry it
    recoveries: list[Recovery]  # the group re-formed while the model was installed (``prepare_members``)
    failures: int  # the losses among them

    def evaluate_once(self, data: Any, steps: int | None) -> dict: ...

    def replan_validation(self) -> None: ...


class ElasticFit:
    """The client's side of one elastic ``fit``: its ledger, its recoveries, the plan of each epoch's rest.

    Parameters
    ----------
    runner
        The model's epoch runner.
    options
        The strategy's ``ElasticOptions``.
    """

    def __init__(self, runner: EpochRunner, options: ElasticOptions):
        self.runner = runner
        self.model: Model = runner.model
        self.options = options
        from daskdist.strategy.spmd import SpmdExtended

        strategy = self.model.distribute_strategy
        if strategy is None or not isinstance(strategy.extended, SpmdExtended):
            raise ValueError(f"model {self.model.name!r} was not created in the scope of an elastic strategy")
        self.strategy = strategy
        self.extended = strategy.extended  # its group re-forms; it takes in the members (``membership_changed``)
        self.group = self.extended.group
        self.fit_id = next(_FITS)
        self.ledger = DataLedger()
        self.events: list[Recovery] = []
        self.failures = runner.failures  # the losses while the model was installed count against max_failures
        self.train: Dataset = runner.train
        self.input = EpochInput(self.strategy, self.train, options)
        self.rows = self.input.rows
        logger.info("Elastic fit %d: epochs read %s", self.fit_id, self.input.describe_order())
        self._committed: CommitKey | None = None
        self._first_epoch = 0
        self._callbacks: Any = None  # the fit's CallbackList, told of membership changes
        self._untold: list[Recovery] = []  # changes before the first epoch (growth at the start): told then
        self.plans = EpochPlans(self.strategy, self.input)
        self._schedule = self.input.schedule(0)
        self.events += runner.recoveries  # a loss while the model was installed: an event of this fit
        self._untold += runner.recoveries  # its callbacks are told at the first epoch (the options were told)

    # -- epochs ---------------------------------------------------------------------

    def begin(self, epoch: int) -> None:
        """The commit every replica can go back to before the first step (the model built everywhere)."""
        self._first_epoch = epoch
        if self.events and self.model.history is not None:
            self.model.history.elastic_events = [e.to_msg() for e in self.events]
        remember_members(self.group)  # a member lost later is known by its Dask name (its cooldown)
        if self.group.size < self.options.min_replicas:
            # below min_replicas (an earlier run ended in that error, or the strategy started smaller): wait for
            # workers (they get the survivors' newest commit: a group that never committed commits first), or
            # raise again; never train below min_replicas
            if not all(self.group.call(commit_keys)):
                self._take_first_commit(epoch)
            self._change(refill)
        self._take_first_commit(epoch)
        # free workers (the cluster scaled back after a loss, say) join at the start of every fit, up to
        # max_replicas, not only below min_replicas: they get the commit just taken (a loss meanwhile goes back
        # to it, or to an older one every member holds, and the first epoch starts from its step 0 anyway)
        if self._change(grow) is not None:
            self._take_first_commit(epoch)

    def _take_first_commit(self, epoch: int) -> None:
        while True:
            try:
                shape, dtype = _input_shape(self.runner.dist_train.element_spec)
                key = (self.fit_id, epoch, 0)
                self.group.call(take_commit, (self.model.model_id, key, shape, dtype))
                self._committed = key
                return
            except RECOVERABLE as error:
                self._recover(error)

    def train_epoch(self, epoch: int, steps: int | None, cb: Any) -> dict:
        """One epoch, resumed from the newest common commit after each loss; the epoch's logs."""
        self._callbacks = cb
        untold, self._untold = self._untold, []
        for outcome in untold:  # a growth at the start of the fit, before the callbacks were known
            self._tell_callbacks(outcome)
        schedule = self._schedule = self.input.schedule(epoch)
        first, start = 0, None
        if epoch > self._first_epoch:
            # an epoch boundary is a commit boundary: retiring members leave and free workers join here
            recovered = self._change(leave) or self._change(grow)
            if recovered is not None:
                first, start = self._resume(epoch, first, *recovered)
        while True:
            try:
                dist, total = self.plans.rest(epoch, schedule, first, steps, self.group.size)  # a loss while planning: recover too
                lr = float(self.model.optimizer.learning_rate)
                room = self.options.max_replicas is None or self.group.size < self.options.max_replicas
                args = (self.model.model_id, dist, total - first, lr, self.runner.tag, (self.fit_id, epoch), first,
                        self.options.commit_every, start, self.options.admit_seconds, room)
                logs = self.group.call(elastic_train_epoch, args)[0]
                if "stopped_at" in logs:  # members retire or free workers wait: at this commit, then go on
                    stop = int(logs["stopped_at"])
                    self.ledger.record(epoch, range(first, stop), schedule)
                    progress = self.group.call(commit_progress, ((self.fit_id, epoch, stop),), member=0)[0]
                    first, start = stop, (progress["loss_sum"], progress["count"])
                    recovered = (self._change(leave) if logs.get("leave") else None) or self._change(grow)
                    if recovered is not None:  # a loss while admitting: back to the commit all members hold
                        first, start = self._resume(epoch, first, *recovered)
                    continue
            except RECOVERABLE as error:
                first, start = self._resume(epoch, first, *self._recover(error))
                continue
            self.ledger.record(epoch, range(first, total), schedule)
            self._committed = (self.fit_id, epoch, total)
            return dict(logs)

    def _resume(self, epoch: int, first: int, key: CommitKey, progress: dict) -> tuple[int, Any]:
        """After going back to commit ``key``: the ledger up to it, and the step and progress to go on from."""
        if key[1] == epoch and key[2] > first:
            self.ledger.record(epoch, range(first, key[2]), self._schedule)
        elif key[1] < epoch or key[2] < first:
            self.ledger.rollback(epoch, key[2] if key[1] == epoch else 0)
        if key[1] != epoch or key[2] == 0:
            return 0, None
        return key[2], (progress["loss_sum"], progress["count"])

    def evaluate(self, data: Any, steps: int | None) -> dict:
        """Validation, run again on the new members if one is lost meanwhile (it changes no state)."""
        while True:
            try:
                return self.runner.evaluate_once(data, steps)
            except RECOVERABLE as error:
                self._recover(error)

    # -- recovery -------------------------------------------------------------------

    def _recover(self, error: BaseException) -> tuple[CommitKey, dict]:
        while True:  # a loss while the strategy takes in the new members is recovered from like any other
            outcome, self.failures = recover_within_budget(self.group, self.options, error, self.failures,
                                                           install_newcomer=self._install_newcomer)
            try:
                self.extended.membership_changed()
                break
            except RECOVERABLE as again:
                error = again
        self.events.append(outcome)
        self._notify(outcome)
        history = self.model.history
        if history is not None:
            history.elastic_events = [e.to_msg() for e in self.events]
        # the rest of the epoch, later epochs and validation are planned over the new members
        self._forget_plan()
        self.runner.replan_validation()
        progress = self.group.call(commit_progress, (outcome.commit,), member=0)[0]
        return outcome.commit, progress

    def _change(self, change: Any) -> tuple[CommitKey, dict] | None:
        """At a commit boundary: ``leave`` (retiring members go), ``grow`` (free workers join, up to
        ``max_replicas``) or ``refill`` (below ``min_replicas``), then plan the coming steps over the members.

        Returns the commit and progress a loss meanwhile sent the group back to, else ``None``.
        """
        try:
            outcome = change(self.group, self.options, self._install_newcomer)
        except RECOVERABLE as error:
            return self._recover(error)
        if outcome is None:
            return None
        try:
            self.extended.membership_changed()
        except RECOVERABLE as error:
            return self._recover(error)
        self.events.append(outcome)
        self._notify(outcome)
        if self.model.history is not None:
            self.model.history.elastic_events = [e.to_msg() for e in self.events]
        self._forget_plan()
        self.runner.replan_validation()
        return None

    def _forget_plan(self) -> None:
        """Plan again at the next epoch command (the members changed); the old plan's shards are released."""
        self.plans.forget()

    def _notify(self, outcome: Recovery) -> None:
        """Tell the user of a membership change (to rescale a learning rate, say), before training goes on.

        ``ElasticOptions.on_membership_change(old, new)`` with the replica counts, then every callback of
        the fit that defines ``on_membership_change(event)`` with the event.
        """
        notify_membership_change(self.options, outcome)
        if self._callbacks is None:
            self._untold.append(outcome)
        else:
            self._tell_callbacks(outcome)

    def _tell_callbacks(self, outcome: Recovery) -> None:
        for callback in getattr(self._callbacks, "callbacks", []):
            hook = getattr(callback, "on_membership_change", None)
            if hook is not None:
                hook(outcome.to_msg())

    def _install_newcomer(self, rank: int) -> None:
        from daskdist.group.service import MODEL
        from daskdist.strategy.replica_commands import install_resident

        self.extended.run_on_replica(rank, install_resident, (MODEL, self.model.model_id,
                                                                       self.model.resident()))


def prepare_members(strategy: Any, options: ElasticOptions, prepare: Callable[[], None]) -> tuple[list[Recovery], int]:
    """Before an elastic ``fit`` (or evaluate): ``prepare()`` (install the model, distribute the data) on the
    members, run again on the members left after each loss; the changes (``Recovery``) and the losses counted.

    Nothing is committed before the fit's first step, so nothing is restored: the group is re-formed on the
    members left (``reform_before_commit``) and ``prepare`` installs the model again where it is not yet
    installed. The fit's start then takes the first commit and admits workers up to ``min_replicas``.

    Raises
    ------
    ElasticRecoveryError
        ``max_failures`` is exhausted, or a failure the scheduler announced no new generation for.
    """
    catch_up(strategy)  # members that left while the group ran nothing (retired, lost)
    group = strategy.extended.group
    recoveries: list[Recovery] = []
    failures = 0
    while True:
        before = group.membership
        try:
            if recoveries:  # the strategy takes in the members left (a loss meanwhile: recovered the same way)
                strategy.extended.membership_changed()
            prepare()
            return recoveries, failures
        except RECOVERABLE as error:
            outcome, failures = reform_before_commit(group, options, error, failures, before)
            recoveries.append(outcome)
            notify_membership_change(options, outcome)


def catch_up(strategy: Any) -> None:
    """Before an elastic ``fit`` (or evaluate, predict): learn the membership changes made while the group ran
    nothing (a member retired or lost between two calls), so that the first command goes to the members left.

    Nothing is restored: every command before completed on every member, so the survivors hold one state.
    """
    group = strategy.extended.group
    before = group.membership
    membership = group.refresh_membership()
    if membership.generation != before.generation:
        logger.info("Elastic group %s moved from %s to %s while idle", group.group_id, before.addresses,
                    membership.addresses)


def _input_shape(element_spec: Any) -> tuple[tuple[int, ...] | None, str | None]:
    """The shape (without the batch) and dtype of the model input ``x`` of an element spec."""
    import optree

    x = element_spec
    if isinstance(x, (tuple, list)):
        x = x[0]
    elif isinstance(x, dict) and "x" in x:
        x = x["x"]
    leaves = optree.tree_leaves(x, is_leaf=lambda s: hasattr(s, "shape") and hasattr(s, "dtype"))
    if len(leaves) != 1:
        return None, None
    spec = leaves[0]
    return tuple(int(d) for d in spec.shape[1:]), str(np.dtype(spec.dtype))
