"""``fit`` on an elastic strategy, for every adapter: epochs in committed steps, recovered after a loss.

The client's side is an ``ElasticRunner`` (an ``elastic.session.ElasticSession``):
``EpochInput`` fixes each epoch's row order and plans the rest of an epoch
over whatever members are left; the replicas run ``elastic_train_epoch``,
committing every ``commit_every`` steps and at the end of each epoch (the
commits copied off the step's path, most of them replayed: ``training.commits``);
after a loss the session re-forms the group and puts every member back at
the newest commit all of them hold, and the epoch goes on from that step with
the same global batches split over the members left. Membership changes at
commits: free workers join, retiring members leave (the replicas answer
``{"stopped_at": step}``, the group changes, the epoch goes on). An adapter
says only how the first commit is taken, how a newcomer gets the model, and
what the epoch command carries besides the trainer's arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from daskdist import fault_points
from daskdist.elastic.boundary import FreeWorkerWatch, StopAtCommit, stop_reply
from daskdist.elastic.recovery import RECOVERABLE
from daskdist.elastic.replica import commit_now
from daskdist.elastic.session import ElasticSession
from daskdist.group.service import MODEL
from daskdist.training.commits import Commits
from daskdist.training.loop import ReplicaLoop
from daskdist.training.progress import ProgressReporter
from daskdist.training.replica import ReplicaModel
from daskdist.training.timer import RecordingTimer

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService
    from daskdist.strategy.drivers.contract import StepDriver

__all__ = ["ElasticReplicaModel", "ElasticRunner", "elastic_train_epoch"]


class ElasticReplicaModel(ReplicaModel, Protocol):
    """A ``ReplicaModel`` that elastic epochs commit and replay (``training.commits``)."""

    exchange_hook: Callable[[Any], Any] | None
    step_totals: Any

    def step_state(self) -> dict[str, Any]:
        """What a step's forward changes before its apply: ``{"rng": ..., "moving": {...}}``, copied."""

    def replay(self, gradients: Any, learning_rate: float | None) -> None:
        """Apply the reduced gradients of steps again, in order (a replayed commit rebuilt)."""

    def replayed_snapshot(self, forward: dict[str, Any], metrics: list[Any]) -> dict[str, Any]:
        """The ``snapshot`` after a replay, with the commit's forward state and metric totals."""

    def local_metric_totals(self) -> list[Any]:
        """This replica's share of the epoch's metric totals (summed over the replicas at a commit)."""

    def keep_metric_totals(self, totals: list[Any]) -> None:
        """The epoch's metric totals at the newest commit (the next ``snapshot`` keeps them)."""

    def resume_metrics(self, rank: int, totals: list[Any] | None = None) -> None:
        """Mid-epoch, from a commit: the epoch's metric totals so far on replica 0 (zeros elsewhere)."""

    def commit_metrics(self) -> None:
        """Sum the metric totals over the replicas now and keep them (the epoch's end commit)."""


def elastic_train_epoch(service: ReplicaService, model_id: str, batches: Any, steps: int, driver: StepDriver,
                        learning_rate: float | None, key: tuple[int, int], first_step: int, commit_every: int,
                        tag: str, admit_every: float | None = None, room: bool = False,
                        with_state: bool = False) -> dict[str, Any]:
    """Steps ``first_step`` ... of an elastic epoch, committing every ``commit_every`` steps and at the end.

    ``batches`` holds the epoch's global batches from ``first_step`` on
    (planned over this generation's members); ``steps`` is their count;
    ``key`` is ``(fit, epoch)``. A commit keeps every resident's state, this
    model's with the epoch's metric totals so far (summed over the replicas,
    so a replica lost later still counts); how a commit stays off the step's
    path: ``training.commits.Commits``. With ``admit_every`` (seconds) and
    ``room`` (the group may grow) replica 0 looks for free workers; when some
    wait, or the scheduler said members retire, every replica stops at that
    commit and answers ``{"stopped_at": step, "leave": ...}``
    (``elastic.boundary``). Replica 0 sends progress events (tag, epoch,
    step; no end-of-epoch event: a step number that only goes up). Returns the epoch's global logs and, with ``with_state``, replica
    0's model state.
    """
    resident: ElasticReplicaModel = service.objects.get(MODEL, model_id)
    resident.set_learning_rate(learning_rate)
    fit, epoch = key
    commits = Commits(service, model_id, resident, driver, FreeWorkerWatch(service, admit_every, room),
                      (fit, epoch, first_step), learning_rate)
    loop = ReplicaLoop(batches, RecordingTimer(service), fault_points.arm(service.rank, resident.step_count))
    resident.begin_loop("train", loop.timer)
    if first_step:  # the epoch's metric totals at the commit it goes on from: all on replica 0, zeros elsewhere
        resident.resume_metrics(service.rank, commits.totals_at((fit, epoch, first_step)))
    step, last = first_step, first_step + steps
    progress = ProgressReporter(service, tag, epoch, first_step)
    resident.exchange_hook = commits.exchange
    try:
        while step < last:
            commits.before_step(at_commit=(step + 1) % commit_every == 0 and step + 1 != last)
            if not loop.steps(1, lambda batch: resident.train_batch(batch, driver)):
                break
            step += 1
            progress(step - first_step, resident.progress_logs)
            commits.after_step((fit, epoch, step))
    except StopAtCommit as stop:
        service.flush_step_events()
        return stop_reply(stop)
    finally:
        resident.exchange_hook = None
        loop.close()
        resident.end_loop("train")
        commits.finish()  # a commit whose totals no step carried is dropped (the epoch's end follows); its copy ends
    if step > first_step:  # the epoch's end: moving statistics averaged, then committed as they now are
        resident.end_train()
        resident.commit_metrics()
        commit_now(service, (fit, epoch, step))
    logs = resident.global_logs("train")
    service.flush_step_events()
    return {"logs": logs, "state": resident.snapshot() if with_state and service.rank == 0 else None}


class ElasticRunner(ElasticSession):
    """The client's side of one elastic ``fit`` (an ``ElasticSession``: its ledger, recoveries and plans).

    Subclasses (the adapters) say how the first commit is taken (``take_first_commit``) and how a newcomer
    gets the model (``install_newcomer``).

    Attributes
    ----------
    model_id
        The model's resident id on the replicas.
    with_state
        Whether replica 0 returns the model's state after each epoch.
    """

    model_id: str
    with_state: bool = False
    fit_id: int = 0

    def call_members(self, command: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Any]:
        """``command(service, *args)`` on every member of the current generation: one reply per member (for an
        adapter's own commands, e.g. the first commit; a loss raises the recoverable error)."""
        replies: list[Any] = self.group.call(command, args)
        return replies

    def train_epoch(self, epoch: int, limit: int | None, driver: StepDriver, learning_rate: float | None,
                    tag: str) -> dict[str, Any]:
        """One epoch, resumed from the newest common commit after each loss and going on after each change at a
        commit (retiring members leave, free workers join); ``{"logs", "state"}``."""
        schedule = self.input.schedule(epoch)
        first = 0
        recovered = self.change_at_epoch_start(epoch)
        if recovered is not None:
            first = self.resumed_step(epoch, first, recovered, schedule)
        while True:
            try:
                batches, total = self.plans.rest(epoch, schedule, first, limit, self.group.size)
                args = (self.model_id, batches, total - first, driver, learning_rate, (self.fit_id, epoch), first,
                        self.options.commit_every, tag, self.options.admit_seconds, self.room, self.with_state)
                result: dict[str, Any] = self.group.call(elastic_train_epoch, args)[0]
                if "stopped_at" in result:  # members retire or free workers wait: at this commit, then go on
                    stop = int(result["stopped_at"])
                    self.ledger.record(epoch, range(first, stop), schedule)
                    first = stop
                    recovered = self.change_at_commit(result)
                    if recovered is not None:  # a loss while changing: back to the commit all members hold
                        first = self.resumed_step(epoch, first, recovered, schedule)
                    continue
            except RECOVERABLE as error:
                first = self.resumed_step(epoch, first, self.recover(error), schedule)
                continue
            self.ledger.record(epoch, range(first, total), schedule)
            return result
