"""``fit`` of a Keras 3 model on an elastic strategy: epochs in committed steps, recovered after a loss.

The client's side; it reuses daskdist's elastic machinery as the built-in
layers' ``fit`` does (``daskdist.elastic``): ``EpochInput`` fixes each
epoch's row order and plans the rest of an epoch over whatever members are
left, the replicas commit every ``commit_every`` steps and at the end of each
epoch (``commands.elastic_train_epoch``: ``commit_now`` snapshots every
resident, the model's ``KerasTrainable`` with its optimizer state and the
epoch's metric totals), and after a loss ``recover_within_budget`` re-forms
the group and puts every member back at the newest commit all of them hold.
The epoch then goes on from that step with the same global batches, split
over the members left, so the weights are those of an uninterrupted run
(the SPMD step driver's gradient is that of the global batch whatever its
split), and the ledger holds every row of every epoch once.

Workers are admitted only where a recovery needs them (below
``min_replicas``); growing into free workers at commits and graceful
retirements mid-epoch are the built-in layers' for now (a retiring member
is recovered from like a lost one).
"""

from __future__ import annotations

import logging
from typing import Any

from daskdist.data.dataset import Dataset
from daskdist.elastic.epochs import EpochInput, EpochPlans
from daskdist.elastic.fit import catch_up
from daskdist.elastic.ledger import DataLedger, EpochSchedule
from daskdist.elastic.options import ElasticOptions, notify_membership_change
from daskdist.elastic.recovery import RECOVERABLE, Recovery, recover_within_budget, remember_members
from daskdist.elastic.replica import CommitKey, commit_keys, commit_now
from daskdist.plugins.keras3 import commands
from daskdist.plugins.keras3.backend import keras_backend
from daskdist.plugins.keras3.payload import pack_model

__all__ = ["KerasElasticFit"]

logger = logging.getLogger(__name__)


class KerasElasticFit:
    """One elastic ``fit`` of a Keras 3 model: its ledger, its recoveries, the plan of each epoch's rest.

    Parameters
    ----------
    model
        The client's Keras model (recorded in the strategy's scope).
    record
        Its record (``registry.Record``): the strategy and the replicas' copy's id.
    dataset
        The training data as a batched ``daskdist.data.Dataset`` (the global batch).
    options
        The strategy's ``ElasticOptions``.

    Attributes
    ----------
    ledger
        ``DataLedger``: the rows of every committed step, per epoch.
    events
        ``Recovery`` of every loss survived.
    rows
        The epoch's rows (``RowMap``), to read the ledger's positions.
    """

    def __init__(self, model: Any, record: Any, dataset: Dataset, options: ElasticOptions):
        self.model = model
        self.record = record
        self.strategy = record.strategy
        self.extended = self.strategy.extended
        self.options = options
        catch_up(self.strategy)  # members that left while the group ran nothing
        self.group = self.extended.group
        self.input = EpochInput(self.strategy, dataset, options)
        self.rows = self.input.rows
        self.ledger = DataLedger()
        self.events: list[Recovery] = []
        self.failures = 0
        self.callbacks: Any = None  # the fit's CallbackList: told of membership changes
        self.history: Any = None  # the fit's History: its elastic_events
        self.fit_id = 0
        self.plans = EpochPlans(self.strategy, self.input)
        self.generation = 0  # membership changes so far (the client re-plans validation data on a change)

    # -- epochs ---------------------------------------------------------------------

    def begin(self, epoch: int) -> None:
        """Before the first epoch: a commit every member can go back to (newer than any commit they hold)."""
        remember_members(self.group)
        while True:
            try:
                held = self.group.call(commit_keys)
                self.fit_id = 1 + max((int(key[0]) for keys in held for key in keys), default=0)
                self.group.call(commit_now, ((self.fit_id, epoch, 0),))
                return
            except RECOVERABLE as error:
                self._recover(error)

    def train_epoch(self, epoch: int, limit: int | None, driver: Any, learning_rate: float | None,
                    tag: str) -> dict[str, Any]:
        """One epoch, resumed from the newest common commit after each loss; ``{"logs", "state"}``."""
        schedule = self.input.schedule(epoch)
        first = 0
        while True:
            try:
                batches, total = self.plans.rest(epoch, schedule, first, limit, self.group.size)
                args = (self.record.object_id, batches, total - first, driver, learning_rate,
                        (self.fit_id, epoch), first, self.options.commit_every, tag)
                result: dict[str, Any] = self.group.call(commands.elastic_train_epoch, args)[0]
            except RECOVERABLE as error:
                first = self._resume(epoch, first, self._recover(error), schedule)
                continue
            self.ledger.record(epoch, range(first, total), schedule)
            return result

    def evaluate(self, make_data: Any, steps: int | None) -> dict[str, float]:
        """Validation (``make_data()``: its distributed dataset), run again on the new members after a loss."""
        while True:
            try:
                logs: dict[str, float] = self.group.call(commands.evaluate,
                                                         (self.record.object_id, make_data(), steps))[0]
                return logs
            except RECOVERABLE as error:
                self._recover(error)

    def _resume(self, epoch: int, first: int, key: CommitKey, schedule: EpochSchedule) -> int:
        """After going back to commit ``key``: the ledger up to it, and the step of ``epoch`` to go on from."""
        if key[1] == epoch and key[2] > first:
            self.ledger.record(epoch, range(first, key[2]), schedule)
        elif key[1] < epoch or key[2] < first:
            self.ledger.rollback(epoch, key[2] if key[1] == epoch else 0)
        return key[2] if key[1] == epoch else 0

    # -- recovery -------------------------------------------------------------------

    def _recover(self, error: BaseException) -> CommitKey:
        while True:  # a loss while the strategy takes in the new members is recovered from like any other
            outcome, self.failures = recover_within_budget(self.group, self.options, error, self.failures,
                                                           install_newcomer=self._install_newcomer)
            try:
                self.extended.membership_changed()
                break
            except RECOVERABLE as again:
                error = again
        self.events.append(outcome)
        self.generation += 1
        notify_membership_change(self.options, outcome)
        for callback in getattr(self.callbacks, "callbacks", []):
            hook = getattr(callback, "on_membership_change", None)
            if hook is not None:
                hook(outcome.to_msg())
        if self.history is not None:
            self.history.elastic_events = [e.to_msg() for e in self.events]
        self.plans.forget()  # the rest of the epoch is planned over the new members
        return outcome.commit

    def _install_newcomer(self, rank: int) -> None:
        """Give a newcomer the model (its weights and optimizer state then come with the commit)."""
        payload = pack_model(self.model, keras_backend())
        self.extended.run_on_replica(rank, commands.install_model, (self.record.object_id, payload))
