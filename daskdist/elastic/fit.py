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
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from daskdist.data.dataset import Dataset
from daskdist.elastic.options import ElasticOptions
from daskdist.elastic.recovery import RECOVERABLE, Recovery
from daskdist.elastic.replica import CommitKey, commit_progress, elastic_train_epoch, take_commit
from daskdist.elastic.session import ElasticSession

if TYPE_CHECKING:
    from daskdist.keras.models import Model

__all__ = ["ElasticFit", "EpochRunner"]

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


class ElasticFit(ElasticSession):
    """The built-in layers' side of one elastic ``fit`` (``ElasticSession``): commits of the epoch's loss totals,
    growth into free workers and retirements at commits, a group below ``min_replicas`` refilled at the start.

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
        from daskdist.strategy.spmd import SpmdExtended

        strategy = self.model.distribute_strategy
        if strategy is None or not isinstance(strategy.extended, SpmdExtended):
            raise ValueError(f"model {self.model.name!r} was not created in the scope of an elastic strategy")
        # the losses while the model was installed are events of this fit and count against max_failures
        super().__init__(strategy, options, runner.train, runner.recoveries, runner.failures)
        self.fit_id = next(_FITS)
        self.train: Dataset = runner.train
        logger.info("Elastic fit %d: epochs read %s", self.fit_id, self.input.describe_order())
        self._committed: CommitKey | None = None
        self._schedule = self.input.schedule(0)

    def history_of_fit(self) -> Any:
        return self.model.history

    def replanned(self) -> None:
        self.runner.replan_validation()

    # -- epochs ---------------------------------------------------------------------

    def take_first_commit(self, epoch: int) -> None:
        """The commit every replica can go back to before the first step (the model built everywhere)."""
        while True:
            try:
                shape, dtype = _input_shape(self.runner.dist_train.element_spec)
                key = (self.fit_id, epoch, 0)
                self.group.call(take_commit, (self.model.model_id, key, shape, dtype))
                self._committed = key
                return
            except RECOVERABLE as error:
                self.recover(error)

    def train_epoch(self, epoch: int, steps: int | None, cb: Any) -> dict:
        """One epoch, resumed from the newest common commit after each loss; the epoch's logs."""
        self.set_callbacks(cb)  # a growth at the start of the fit, before the callbacks were known: told now
        schedule = self._schedule = self.input.schedule(epoch)
        first, start = 0, None
        recovered = self.change_at_epoch_start(epoch)
        if recovered is not None:
            first, start = self._resume(epoch, first, recovered)
        while True:
            try:
                dist, total = self.plans.rest(epoch, schedule, first, steps, self.group.size)  # a loss while planning: recover too
                lr = float(self.model.optimizer.learning_rate)
                args = (self.model.model_id, dist, total - first, lr, self.runner.tag, (self.fit_id, epoch), first,
                        self.options.commit_every, start, self.options.admit_seconds, self.room)
                logs = self.group.call(elastic_train_epoch, args)[0]
                if "stopped_at" in logs:  # members retire or free workers wait: at this commit, then go on
                    stop = int(logs["stopped_at"])
                    self.ledger.record(epoch, range(first, stop), schedule)
                    progress = self.group.call(commit_progress, ((self.fit_id, epoch, stop),), member=0)[0]
                    first, start = stop, (progress["loss_sum"], progress["count"])
                    recovered = self.change_at_commit(logs)
                    if recovered is not None:  # a loss while admitting: back to the commit all members hold
                        first, start = self._resume(epoch, first, recovered)
                    continue
            except RECOVERABLE as error:
                first, start = self._resume(epoch, first, self.recover(error))
                continue
            self.ledger.record(epoch, range(first, total), schedule)
            self._committed = (self.fit_id, epoch, total)
            return dict(logs)

    def _resume(self, epoch: int, first: int, key: CommitKey) -> tuple[int, Any]:
        """After going back to commit ``key``: the step and the epoch's loss totals to go on from."""
        step = self.resumed_step(epoch, first, key, self._schedule)
        if step == 0:
            return 0, None
        progress = self.group.call(commit_progress, (key,), member=0)[0]
        return step, (progress["loss_sum"], progress["count"])

    def evaluate(self, data: Any, steps: int | None) -> dict:
        """Validation, run again on the new members if one is lost meanwhile (it changes no state)."""
        result: dict = self.with_recovery(lambda: self.runner.evaluate_once(data, steps))
        return result

    def install_newcomer(self, rank: int) -> None:
        from daskdist.group.service import MODEL
        from daskdist.strategy.replica_commands import install_resident

        self.extended.run_on_replica(rank, install_resident, (MODEL, self.model.model_id,
                                                                       self.model.resident()))


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
