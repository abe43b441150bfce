"""One elastic session: what every elastic run of epochs shares, whatever trains (built-in layers, Keras 3).

Client side. ``ElasticSession`` holds a run's ledger, its recoveries and
the plan of each epoch's rest, and does what follows a membership change
the same way for every trainer: a loss is recovered from
(``recover_and_take_in``: the group re-formed at the newest commit all
members hold, the strategy taking in the members left, a second loss
meanwhile recovered from the same way), the event is kept and told
(``ElasticOptions.on_membership_change``, the fit's callbacks, its
``History``), the rest of the epoch is planned again over the new members,
and the ledger goes back or forward to the commit (``resumed_step``). A loss
while the model is installed, before anything is committed, re-forms the
group and installs again (``prepare_members``). ``dd.elastic.State`` (custom
loops) recovers through the same ``recover_and_take_in``.

A fit's start (``begin``: a group below ``min_replicas`` refilled, the first
commit, free workers admitted) and its commit boundaries (``change_at_epoch_start``,
``change_at_commit``: retiring members leave, free workers join) are the
session's too. The trainers add what is theirs: how the first commit is
taken (``take_first_commit``) and how a newcomer gets the model; the
epochs themselves are the trainer's (``daskdist.training.elastic.ElasticRunner``),
whose adapters are the built-in layers' ``ElasticFit``
(``daskdist/keras/elastic_fit.py``) and the Keras 3 adapter's
(``daskdist/plugins/keras3/elastic.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from daskdist.data.dataset import Dataset
from daskdist.elastic.epochs import EpochInput, EpochPlans
from daskdist.elastic.ledger import DataLedger, EpochSchedule
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
from daskdist.elastic.replica import CommitKey, commit_keys

__all__ = ["ElasticSession", "catch_up", "prepare_members", "recover_and_take_in"]

logger = logging.getLogger(__name__)


def recover_and_take_in(extended: Any, options: ElasticOptions, error: BaseException, failures: int,
                        install_newcomer: Callable[[int], None] | None = None) -> tuple[Recovery, int]:
    """Recover ``extended``'s group from ``error`` and let the strategy take in the members left.

    A loss while the strategy takes them in (``membership_changed``) is
    recovered from like any other. Returns the outcome and the new failure
    count (``recover_within_budget``).
    """
    while True:
        outcome, failures = recover_within_budget(extended.group, options, error, failures,
                                                  install_newcomer=install_newcomer)
        try:
            extended.membership_changed()
            return outcome, failures
        except RECOVERABLE as again:
            error = again


def prepare_members(strategy: Any, options: ElasticOptions, prepare: Callable[[], None]) -> tuple[list[Recovery], int]:
    """Before an elastic ``fit`` (or evaluate): ``prepare()`` (install the model, distribute the data) on the
    members, run again on the members left after each loss; the changes (``Recovery``) and the losses counted.

    Nothing is committed before the fit's first step, so nothing is restored: the group is re-formed on the
    members left (``reform_before_commit``) and ``prepare`` installs the model again where it is not yet
    installed. The fit's start then takes the first commit.

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


class ElasticSession:
    """The client's side of one elastic run of epochs: its ledger, its recoveries, the plan of each epoch's rest.

    Parameters
    ----------
    strategy
        The elastic strategy (its Extended's group re-forms).
    options
        The strategy's ``ElasticOptions``.
    train
        The training data as a batched ``daskdist.data.Dataset`` (the global batch); refused here, before
        anything runs on the replicas, when an epoch of it cannot be planned again (``EpochInput``).
    recoveries
        Changes made while the model was installed (``prepare_members``): events of this run, told to its
        callbacks once they are known.
    failures
        The losses among them (they count against ``max_failures``).

    Attributes
    ----------
    ledger
        ``DataLedger``: the rows of every committed step, per epoch.
    events
        ``Recovery`` of every membership change.
    rows
        The epoch's rows (``RowMap``), to read the ledger's positions.
    generation
        Membership changes since the session began (data planned for the members, validation's, is planned
        again when it moves).
    """

    def __init__(self, strategy: Any, options: ElasticOptions, train: Dataset, recoveries: Iterable[Recovery] = (),
                 failures: int = 0):
        self.strategy = strategy
        self.extended = strategy.extended  # its group re-forms; it takes in the members (``membership_changed``)
        self.group = self.extended.group
        self.options = options
        self.input = EpochInput(strategy, train, options)
        self.rows = self.input.rows
        self.plans = EpochPlans(strategy, self.input)
        self.ledger = DataLedger()
        self.events: list[Recovery] = []
        self.failures = failures
        self.generation = 0
        self.history: Any = None  # the fit's History: its ``elastic_events``
        self.first_epoch = 0  # the fit's first epoch (``begin``): later epochs start at a commit boundary
        self._callbacks: Any = None  # the fit's CallbackList, told of membership changes
        self._untold: list[Recovery] = []  # changes before the callbacks were known: told when they are
        self.take_prepared(list(recoveries), failures)

    # -- a fit's start and its commit boundaries ---------------------------------------------

    def begin(self, epoch: int) -> None:
        """Before the fit's first epoch: the commit every member can go back to (``take_first_commit``); a group
        below ``min_replicas`` refilled first, free workers admitted after (they get that commit).

        Below ``min_replicas`` (an earlier run ended in that error, or the strategy started smaller) the session
        waits for workers, which get the survivors' newest commit (a group that never committed commits
        first), or raises again: it never trains below ``min_replicas``. Free workers (the cluster scaled back
        after a loss, say) join at the start of every fit, up to ``max_replicas``; a loss meanwhile goes back
        to an older commit every member holds, so the first commit is taken again.
        """
        self.first_epoch = epoch
        self._record_events()
        remember_members(self.group)  # a member lost later is known by its Dask name (its cooldown)
        if self.group.size < self.options.min_replicas:
            if not all(self.group.call(commit_keys)):
                self.take_first_commit(epoch)
            self.change(refill)
        self.take_first_commit(epoch)
        if self.change(grow) is not None:
            self.take_first_commit(epoch)

    def take_first_commit(self, epoch: int) -> None:
        """Commit the members' state before the first step of ``epoch`` (recovering from a loss meanwhile)."""
        raise NotImplementedError(f"{type(self).__name__} takes no first commit")

    @property
    def room(self) -> bool:
        """Whether the group may grow (below ``max_replicas``): the replicas then look for free workers."""
        return self.options.max_replicas is None or self.group.size < self.options.max_replicas

    def change_at_epoch_start(self, epoch: int) -> CommitKey | None:
        """An epoch boundary after the first is a commit boundary: retiring members leave, free workers join.

        Returns the commit a loss meanwhile sent the group back to, else ``None``.
        """
        if epoch <= self.first_epoch:
            return None
        return self.change(leave) or self.change(grow)

    def change_at_commit(self, reply: dict[str, Any]) -> CommitKey | None:
        """The replicas stopped at a commit (``{"stopped_at": step, "leave": ...}``): retiring members leave
        there, free workers join. Returns the commit a loss meanwhile sent the group back to, else ``None``."""
        return (self.change(leave) if reply.get("leave") else None) or self.change(grow)

    # -- the model's install ------------------------------------------------------------

    def prepare(self, prepare: Callable[[], None]) -> None:
        """``prepare()`` (install the model, distribute data) on the members, again after each loss meanwhile."""
        recoveries, failures = prepare_members(self.strategy, self.options, prepare)
        self.take_prepared(recoveries, self.failures + failures)

    def take_prepared(self, recoveries: list[Recovery], failures: int) -> None:
        """The changes made while the model was installed: events of this session (the options were told)."""
        self.failures = failures
        self.events += recoveries
        self._untold += recoveries
        self.generation += len(recoveries)
        self._record_events()

    # -- callbacks and events -----------------------------------------------------------

    def set_callbacks(self, callbacks: Any) -> None:
        """The fit's ``CallbackList``: told of the changes so far, then of each as it happens."""
        self._callbacks = callbacks
        untold, self._untold = self._untold, []
        for outcome in untold:
            self._tell_callbacks(outcome)

    def history_of_fit(self) -> Any:
        """The fit's ``History`` (its ``elastic_events`` follow the session's), or ``None``."""
        return self.history

    def _record_events(self) -> None:
        history = self.history_of_fit()
        if history is not None and self.events:
            history.elastic_events = [e.to_msg() for e in self.events]

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

    # -- membership changes ---------------------------------------------------------------

    def recover(self, error: BaseException) -> CommitKey:
        """After a loss: the group re-formed at the newest commit all members hold; that commit."""
        outcome, self.failures = recover_and_take_in(self.extended, self.options, error, self.failures,
                                                     self.install_newcomer)
        self._changed(outcome)
        return outcome.commit

    def change(self, change: Callable[..., Recovery | None]) -> CommitKey | None:
        """At a commit boundary: ``leave`` (retiring members go), ``grow`` (free workers join, up to
        ``max_replicas``) or ``refill`` (below ``min_replicas``), then plan the coming steps over the members.

        Returns the commit a loss meanwhile sent the group back to, else ``None``.
        """
        try:
            outcome = change(self.group, self.options, self.install_newcomer)
        except RECOVERABLE as error:
            return self.recover(error)
        if outcome is None:
            return None
        try:
            self.extended.membership_changed()
        except RECOVERABLE as error:
            return self.recover(error)
        self._changed(outcome)
        return None

    def _changed(self, outcome: Recovery) -> None:
        """A change done: kept, told, and the rest of the epoch (and validation) planned over the new members."""
        self.events.append(outcome)
        self.generation += 1
        self._notify(outcome)
        self._record_events()
        self.plans.forget()  # the old plan's shards are released; the next epoch command plans again
        self.replanned()

    def replanned(self) -> None:
        """Called after each change: a trainer plans again what it planned over the members (validation)."""

    def install_newcomer(self, rank: int) -> None:
        """Give the newcomer at ``rank`` the model (its weights and optimizer state then come with the commit)."""
        raise NotImplementedError(f"{type(self).__name__} admits no newcomers")

    def resumed_step(self, epoch: int, first: int, key: CommitKey, schedule: EpochSchedule) -> int:
        """After going back to commit ``key`` from step ``first`` of ``epoch``: the ledger up to it, and the step
        of ``epoch`` to go on from (0 when the commit is of another epoch)."""
        if key[1] == epoch and key[2] > first:
            self.ledger.record(epoch, range(first, key[2]), schedule)
        elif key[1] < epoch or key[2] < first:
            self.ledger.rollback(epoch, key[2] if key[1] == epoch else 0)
        return key[2] if key[1] == epoch else 0

    def with_recovery(self, run: Callable[[], Any]) -> Any:
        """``run()``, again on the new members after each loss (for what changes no state: validation)."""
        while True:
            try:
                return run()
            except RECOVERABLE as error:
                self.recover(error)
