"""``dd.elastic.State`` and ``@dd.elastic.run``: elastic custom training loops (Horovod's shape).

::

    @dd.elastic.run
    def train(state):
        while state.epoch < 10:
            for batch in state.batches(dataset):   # this epoch's global batches not yet committed
                strategy.run(step, args=(batch,))
                state.commit()
            state.epoch += 1

    train(dd.elastic.State(strategy, epoch=0))

``commit()`` keeps, on every replica, a copy of its variables and models (the
two newest), and on the client a copy of the state's plain attributes. When a
member is lost the function's call raises; ``run`` recovers the group
(``elastic/recovery.py``), puts back the newest commit all members hold (on
the replicas and in the state's attributes), calls the reset callbacks, and
calls the function again: ``state.epoch`` and ``state.batch`` say where it
goes on, and ``state.batches`` yields only the batches after the commit,
planned over the new members with the same global batch (or, with
``keep="per_replica"``, the same batch per replica). When members retire
(``client.retire_workers``, a worker's ``lifetime``), ``commit()`` raises
once it has committed and ``run`` lets them leave there, restoring nothing
(Horovod's ``HostsUpdatedInterrupt``), then calls the function again. So it
does when free Dask workers wait (looked for every ``admit_every``) and the
group is below ``max_replicas``: ``run`` admits them at that commit, giving
each the state's models and variables and then the commit from a survivor.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from daskdist.data.dataset import Dataset
from daskdist.elastic.epochs import EpochInput, release
from daskdist.elastic.ledger import DataLedger, EpochSchedule, RowMap
from daskdist.elastic.options import notify_membership_change
from daskdist.elastic.recovery import (
    RECOVERABLE,
    Recovery,
    free_workers,
    grow,
    leave,
    remember_members,
)
from daskdist.elastic.replica import CommitKey, commit_now, state_residents
from daskdist.elastic.session import recover_and_take_in
from daskdist.strategy.base import Strategy

__all__ = ["ReplicatedModel", "State", "run"]

logger = logging.getLogger(__name__)

_RUNS = itertools.count(1)
_OWN = ("strategy", "epoch", "batch")


@runtime_checkable
class ReplicatedModel(Protocol):
    """A model whose copies live on the replicas (a built-in ``Model``, ``dd.plugins.torch.TorchModel``).

    Kept among a ``State``'s attributes, a newcomer is installed with its ``resident()`` (the replica's
    copy; the weights then come with the commit), under ``model_id``.
    """

    @property
    def model_id(self) -> str: ...

    def resident(self) -> Any: ...


class State:
    """What an elastic custom loop goes back to after a loss (Horovod's ``hvd.elastic.State``).

    Parameters
    ----------
    strategy
        An elastic strategy (``elastic=dd.ElasticOptions(...)``).
    epoch
        The epoch to start at.
    **attributes
        Anything else the loop keeps (plain values are copied at each commit
        and put back after a loss; models and distributed variables live on
        the replicas, whose commits cover them).

    Attributes
    ----------
    batch
        Global batches of the current epoch taken so far (``batches`` starts after them).
    ledger
        ``DataLedger``: the rows of every committed batch, per epoch.
    events
        ``Recovery`` of every loss survived.
    """

    def __init__(self, strategy: Any, epoch: int = 0, **attributes: Any):
        options = strategy.extended.elastic if isinstance(strategy, Strategy) else None
        if options is None:
            raise ValueError("dd.elastic.State needs an elastic strategy: "
                             "dd.MirroredStrategy(..., elastic=dd.ElasticOptions(min_replicas=...))")
        self.strategy = strategy
        self.options = options
        self.epoch = int(epoch)
        self.batch = 0
        self.ledger = DataLedger()
        self.events: list[Recovery] = []
        self.failures = 0
        self._run_id = next(_RUNS)
        self._serial = itertools.count(1)
        self._commits: OrderedDict[CommitKey, dict[str, Any]] = OrderedDict()
        self._reset_callbacks: list[Callable[[], None]] = []
        self._rows: RowMap | None = None  # the epoch positions of the last dataset's rows
        self._inputs: dict[int, tuple[Dataset, EpochInput]] = {}  # per dataset, its epochs' order
        self._schedules: dict[tuple[int, int], EpochSchedule] = {}  # (dataset, epoch): which rows each batch holds
        self._pending: list[tuple[int, int, EpochSchedule]] = []  # (epoch, batch, schedule) since the last commit
        self._in_run = False  # inside an ``@dd.elastic.run`` function (which lets retiring members leave)
        self._committing: tuple[CommitKey, list[tuple[int, int, EpochSchedule]]] | None = None  # asked, no reply
        self._looked = time.monotonic()  # when ``commit`` last looked for free workers (every ``admit_every``)
        for name, value in attributes.items():
            if name in _OWN or name.startswith("_"):
                raise ValueError(f"{name!r} is not a free State attribute")
            setattr(self, name, value)

    # -- Horovod's verbs ---------------------------------------------------------------

    def commit(self) -> None:
        """Keep this point: the replicas' variables and models, and this state's attributes."""
        key: CommitKey = (self._run_id, next(self._serial), 0)
        # kept before the replicas are asked: they may all commit ``key`` and the reply still be lost (a member
        # lost after committing); the recovery then goes back to ``key``, which must be known here, with the
        # batches it commits (``_recover`` records them then). Three kept: ``key`` and the replicas' two before.
        self._commits[key] = self._plain_attributes()
        while len(self._commits) > 3:
            self._commits.popitem(last=False)
        self._committing = (key, self._pending)
        retiring = self.strategy.extended.group.call(commit_now, (key,))
        self._committing = None
        self._record(self._pending)
        self._pending = []
        if any(retiring) and self._in_run:  # members retire: ``run`` lets them leave here, calls the loop again
            raise _MembersRetiring()
        if self._in_run and self._workers_wait():  # free workers: ``run`` admits them here, calls the loop again
            raise _MembersJoining()

    def _record(self, pending: list[tuple[int, int, EpochSchedule]]) -> None:
        """The batches of a commit every member made, in the ledger."""
        if self._rows is not None:
            for epoch, batch, schedule in pending:
                self.ledger.record(epoch, range(batch, batch + 1), schedule)

    def _workers_wait(self) -> bool:
        """Every ``admit_every``: whether free workers wait and the group is below ``max_replicas``.

        The client asks the scheduler (one call per ``admit_every``, none between); every replica has
        committed already, so all of them stop at this commit.
        """
        every = self.options.admit_seconds
        group = self.strategy.extended.group
        if every is None or (self.options.max_replicas is not None and group.size >= self.options.max_replicas):
            return False
        now = time.monotonic()
        if now - self._looked < every:
            return False
        self._looked = now
        try:
            return bool(free_workers(group, self.options))
        except Exception as e:  # a slow scheduler must not fail the loop: look again later
            logger.debug("Could not look for free workers: %s", e)
            return False

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after a recovery, before the loop goes on (to rescale a learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def batches(self, dataset: Any) -> Iterator[Any]:
        """This epoch's global batches after ``self.batch``, as ``PerReplica`` handles over the current members.

        ``dataset`` is a ``dd.data.Dataset`` batched with the global batch, or
        a distributed dataset made from one. A ``shuffle`` before the batch
        reads the epoch in a seeded permutation decided on the client
        (``elastic/epochs.py``), so the rest of an epoch can be planned again
        after a loss; ``filter``, ``repeat`` and the like are refused.
        """
        dataset = getattr(dataset, "dataset", dataset)
        if not isinstance(dataset, Dataset):
            raise TypeError("state.batches takes a dd.data.Dataset (or a distributed dataset made from one)")
        strategy = self.strategy
        known = self._inputs.get(id(dataset))
        if known is None or known[0] is not dataset:
            known = self._inputs[id(dataset)] = (dataset, EpochInput(strategy, dataset, self.options))
        epoch_input = known[1]
        self._rows = epoch_input.rows
        schedule = self._schedules.get((id(dataset), self.epoch))
        if schedule is None or self.batch == 0:
            schedule = self._schedules[(id(dataset), self.epoch)] = epoch_input.schedule(self.epoch)
            if self.batch:  # an epoch this state never planned (restored from elsewhere): its first replica count
                schedule.start(0, 0, epoch_input.global_batch(epoch_input.first_replicas))
        n = strategy.num_replicas_in_sync
        row = schedule.row_of_step(self.batch) if self.batch else 0
        if self.batch and epoch_input.steps_from(row, n) == 0:
            self.batch = 0  # the loop was left at the epoch's last commit (members retired): nothing remains
            return
        schedule.start(self.batch, row, epoch_input.global_batch(n))
        distributed = strategy.experimental_distribute_dataset(epoch_input.dataset_from(self.epoch, row, n))
        for element in distributed:
            self._pending.append((self.epoch, self.batch, schedule))
            self.batch += 1
            yield element
        release(strategy, distributed)  # the epoch is over: its rows leave the replicas
        self._schedules = {k: v for k, v in self._schedules.items() if k[1] >= self.epoch}
        self.batch = 0

    # -- recovery ---------------------------------------------------------------------

    def _plain_attributes(self) -> dict[str, Any]:
        out = {}
        for name, value in vars(self).items():
            if name.startswith("_") or name in ("strategy", "options", "ledger", "events", "failures"):
                continue
            out[name] = value if _lives_on_replicas(value) else copy.deepcopy(value)
        return out

    def _begin(self) -> None:
        remember_members(self.strategy.extended.group)  # a member lost later is known by its Dask name
        if not self._commits:
            self.commit()

    def _leave(self) -> None:
        """At the commit just taken: the retiring members leave (no rollback), the reset callbacks run."""
        try:
            outcome = leave(self.strategy.extended.group, self.options)
            if outcome is not None:
                self.strategy.extended.membership_changed()
        except RECOVERABLE as error:
            self._recover(error)
            return
        if outcome is not None:
            self.events.append(outcome)
            for callback in self._reset_callbacks:
                callback()

    def _grow(self) -> None:
        """At the commit just taken: free workers join (they receive it from a survivor, nothing is rolled
        back), then ``on_membership_change`` and the reset callbacks run; ``batches`` re-plans the epoch's rest."""
        group = self.strategy.extended.group
        try:
            missing = self._unrebuildable(group.call(state_residents, member=0)[0])
            if missing:
                logger.warning("Elastic loop: not admitting free workers: the replicas hold %s, which are not "
                               "models or variables among the state's attributes, so a newcomer could not "
                               "rebuild them", missing)
                self._looked = float("inf")  # never again in this state
                return
            outcome = grow(group, self.options, self._install_newcomer)
            if outcome is not None:
                self.strategy.extended.membership_changed()
        except RECOVERABLE as error:
            self._recover(error)
            return
        if outcome is None:
            return
        self.events.append(outcome)
        notify_membership_change(self.options, outcome)
        for callback in self._reset_callbacks:
            callback()

    def _rebuildable(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state's models and distributed variables, by resident id (what a newcomer can be given)."""
        from daskdist.variables.distributed import DistributedVariable

        models: dict[str, Any] = {}
        variables: dict[str, Any] = {}
        for value in vars(self).values():
            if isinstance(value, DistributedVariable):
                variables[value.var_id] = value
            elif isinstance(value, ReplicatedModel):  # a built-in Model, an adapter's (dd.plugins.torch)
                models[value.model_id] = value
        return models, variables

    def _unrebuildable(self, residents: list[Any]) -> list[tuple[str, str]]:
        from daskdist.group.service import MODEL, VARIABLE

        models, variables = self._rebuildable()
        known = {(MODEL, i) for i in models} | {(VARIABLE, i) for i in variables}
        return [tuple(r) for r in residents if tuple(r) not in known]

    def _install_newcomer(self, rank: int) -> None:
        """Give the newcomer at ``rank`` the state's models and variables (their values come with the commit)."""
        import numpy as np

        from daskdist.group.service import MODEL
        from daskdist.replica.commands import create_variable
        from daskdist.strategy.extended.replica_commands import install_resident

        extended = self.strategy.extended
        models, variables = self._rebuildable()
        for model_id, model in models.items():
            extended.run_on_replica(rank, install_resident, (MODEL, model_id, model.resident()))
        for var_id, variable in variables.items():
            spec = variable.spec
            extended.run_on_replica(rank, create_variable, (var_id, np.zeros(spec.shape, spec.dtype), spec))

    def _recover(self, error: BaseException) -> None:
        outcome, self.failures = recover_and_take_in(self.strategy.extended, self.options, error, self.failures)
        self.events.append(outcome)
        committing, self._committing = self._committing, None
        if committing is not None and committing[0] == outcome.commit:  # every member made it; the reply was lost
            self._record(committing[1])
        restored = self._commits[outcome.commit]
        for key in [k for k in self._commits if k > outcome.commit]:
            del self._commits[key]
        for name, value in restored.items():
            setattr(self, name, value if _lives_on_replicas(value) else copy.deepcopy(value))
        self._pending = []
        self.ledger.rollback(self.epoch, self.batch)
        notify_membership_change(self.options, outcome)
        for callback in self._reset_callbacks:
            callback()


class _MembersJoining(Exception):
    """Raised by ``State.commit`` when free workers wait: ``run`` admits them there (nothing restored) and
    calls the loop again."""


class _MembersRetiring(Exception):
    """Raised by ``State.commit`` when members retire: ``run`` lets them leave there (Horovod's
    ``HostsUpdatedInterrupt``: nothing restored) and calls the loop again."""


def _lives_on_replicas(value: Any) -> bool:
    from daskdist.variables.distributed import DistributedVariable

    return isinstance(value, (ReplicatedModel, DistributedVariable, Strategy))


def run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``fn(state, ...)`` elastic: after a lost member it is called again from the newest commit."""

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"an elastic.run function takes a dd.elastic.State first, got {type(state).__name__}")
        while True:
            try:
                state._begin()
                state._in_run = True
                try:
                    return fn(state, *args, **kwargs)
                finally:
                    state._in_run = False
            except _MembersRetiring:
                state._leave()
            except _MembersJoining:
                state._grow()
            except RECOVERABLE as error:
                logger.warning("Elastic loop %s: %s; recovering", getattr(fn, "__name__", "fn"), error)
                state._recover(error)

    return wrapper
