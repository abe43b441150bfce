"""Recovering an elastic group after a loss: the new generation, enough members, the commit all hold.

Client side. The scheduler plugin has already re-formed the group on the
survivors (``remove_worker`` under the ``elastic`` policy: survivors abort
their collectives, a new generation is announced, transports and
communicators are rebuilt at the first command of that generation). Here the
client learns the new membership, admits new workers when the group is below
``min_replicas`` (waiting up to ``wait_timeout`` for them), makes every member
go back to the newest commit all of them hold, and checks that every member
then holds the same state (a hash of its bytes).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from daskdist.cluster.identity import scheduler_workers
from daskdist.dashboard.membership import ELASTIC_TOPIC as MEMBERSHIP_EVENTS
from daskdist.elastic.options import ElasticOptions
from daskdist.elastic.quarantine import quarantine_of
from daskdist.elastic.replica import (
    CommitKey,
    commit_keys,
    commit_state,
    install_commit,
    lacking_residents,
    missing_residents,
    restore_commit,
)
from daskdist.exceptions import ElasticRecoveryError, ReplicaLostError, StaleGenerationError
from daskdist.group.handle import ReplicaGroup
from daskdist.group.membership import Membership

__all__ = ["ELASTIC_TOPIC", "NO_COMMIT", "RECOVERABLE", "Recovery", "admit", "free_workers", "grow", "is_final", "leave",
           "recover", "recover_within_budget", "reform_before_commit", "refill", "remember_members"]

logger = logging.getLogger(__name__)

#: The Dask event topic of elastic transitions (``client.get_events("daskdist-elastic")``); the scheduler's
#: dashboard store attaches each to the generation it names.
ELASTIC_TOPIC = MEMBERSHIP_EVENTS
#: What a lost member makes a command raise under the elastic policy (the handle turns broken connections
#: into ``ReplicaLostError``; a user's own exception is never taken for a loss).
RECOVERABLE = (ReplicaLostError, StaleGenerationError)
#: A ``Recovery``'s commit when the loss came before the fit's first commit (nothing to go back to).
NO_COMMIT: CommitKey = (0, 0, 0)


def is_final(error: BaseException) -> bool:
    """Whether a recovery's error ends the elastic run (``ElasticRecoveryError``), rather than being a second loss."""
    return isinstance(error, ElasticRecoveryError)


@dataclasses.dataclass
class Recovery:
    """What one recovery did (kept in ``History.elastic_events``, logged on ``daskdist-elastic``).

    ``generation`` and ``members``: the group after it; ``members_before``: the
    members before the change; ``lost`` / ``left`` (retired gracefully) /
    ``admitted``: the difference;
    ``reason``: what started it (the loss's error, or the workers admitted);
    ``commit``: the ``(fit, epoch, step)`` commit every member holds after it
    (``NO_COMMIT`` for a loss before the fit's first commit, action
    ``"reinstalled"``: the members left were given the model again);
    ``seconds``: how long it took; ``time``: when training went on (wall
    clock, seconds since the epoch).
    """

    generation: int
    members: list[str]
    lost: list[str]
    admitted: list[str]
    commit: CommitKey
    seconds: float
    healed: bool = False
    # "restored" after a loss, "grew" when free workers joined, "left" after a retirement, "reinstalled" after a loss
    # before the first commit
    action: str = "restored"
    left: list[str] = dataclasses.field(default_factory=list)  # members retired (gracefully, no rollback)
    members_before: list[str] = dataclasses.field(default_factory=list)
    reason: str = ""
    time: float = dataclasses.field(default_factory=time.time)

    def to_msg(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "commit": list(self.commit)}

    def describe(self) -> str:
        """One line for the logs: generation, members before and after, lost, admitted, commit, why."""
        return (f"generation {self.generation}: {len(self.members_before)} -> {len(self.members)} members "
                f"(lost {self.lost or 'none'}, left {self.left or 'none'}, admitted {self.admitted or 'none'}), "
                f"at commit {self.commit} "
                f"after {self.seconds:.1f} s; reason: {self.reason or 'not given'}")


def _announce(group: ReplicaGroup, outcome: Recovery) -> None:
    """Log ``outcome`` and send it as a ``daskdist-elastic`` Dask event (the dashboard marks it)."""
    level = logging.WARNING if outcome.action in ("restored", "left") else logging.INFO
    logger.log(level, "Elastic group %s %s: %s", group.group_id, outcome.action, outcome.describe())
    try:
        group.client.log_event(ELASTIC_TOPIC, {"group": group.group_id, "strategy": group.strategy_token,
                                               **outcome.to_msg()})
    except Exception as e:  # events are for watching; never fail a recovery for them
        logger.debug("Could not log the %s event: %s", outcome.action, e)


def recover(group: ReplicaGroup, options: ElasticOptions, error: BaseException,
            install_newcomer: Any = None, members_before: list[str] | None = None) -> Recovery:
    """Bring ``group`` back after ``error`` (a lost member): re-formed, big enough, at one commit.

    Parameters
    ----------
    install_newcomer
        ``install_newcomer(rank)``: puts what a new member needs before the
        commit (a model) on rank ``rank``; ``None``: new workers are not admitted.
    members_before
        The members before the loss (default: the group's members now); a
        second loss during a recovery passes the members before the first.

    Raises
    ------
    ReplicaLostError
        No new generation was announced within ``generation_timeout`` (the
        error was not a loss), the group stayed below ``min_replicas`` for
        ``wait_timeout``, or the survivors hold no common commit.
    """
    start = time.monotonic()
    before = group.membership
    membership = _next_generation(group, before, options.generation_seconds, error)
    previous = list(before.addresses) if members_before is None else list(members_before)
    gone_now = [a for a in before.addresses if a not in membership.addresses]
    retired = _retired(group)
    quarantine_of(group).failed([a for a in gone_now if a not in retired])  # kept out for options.cooldown
    gone = [a for a in previous if a not in membership.addresses]  # since the first loss of this recovery
    lost = [a for a in gone if a not in retired]
    left = [a for a in gone if a in retired]  # retired while the group ran nothing: a leave, not a loss
    admitted: list[str] = []
    if membership.size < options.min_replicas:
        admitted = _wait_for_members(group, options, lost, install_newcomer is not None)
        membership = group.membership
    commit, healed = _restore_common_commit(group, admitted, install_newcomer)
    outcome = Recovery(int(membership.generation), list(membership.addresses), lost, admitted, commit,
                       time.monotonic() - start, healed, action="restored" if lost or not left else "left",
                       left=left, members_before=previous, reason=f"{type(error).__name__}: {error}")
    _announce(group, outcome)
    return outcome


def reform_before_commit(group: ReplicaGroup, options: ElasticOptions, error: BaseException, failures: int,
                         before: Membership) -> tuple[Recovery, int]:
    """After a loss before the fit's first commit (its model being installed): the group on the members left.

    Waits for the scheduler's new generation; nothing is restored and no
    worker admitted here: the caller gives the members left what it was
    giving them (``install`` again replaces whatever half of it arrived), and
    the fit's start (``ElasticFit.begin``) takes the first commit and admits
    workers up to ``min_replicas``, as for a group that starts small. Returns
    the outcome (action ``"reinstalled"``, commit ``NO_COMMIT``) and the new
    failure count (the loss counts against ``max_failures``). ``before``:
    the membership the failed call went to.

    Raises
    ------
    ElasticRecoveryError
        ``max_failures`` is exhausted, or no new generation came within
        ``generation_timeout`` (the error was not a loss).
    """
    if is_final(error):
        raise error
    members_before = list(before.addresses)
    failures += 1
    if 0 <= options.max_failures < failures:
        quarantine_of(group).failed(_failed_members(group, error, members_before))
        raise ElasticRecoveryError(
            f"{error} (the strategy's elastic max_failures={options.max_failures} is exhausted; workers lost: "
            f"{quarantine_of(group).describe() or 'none known'})", worker=getattr(error, "worker", None)) from error
    logger.warning("Elastic training: %s before the first commit; re-forming the group", error)
    start = time.monotonic()
    membership = _next_generation(group, before, options.generation_seconds, error)
    retired = _retired(group)
    gone = [a for a in members_before if a not in membership.addresses]
    quarantine_of(group).failed([a for a in gone if a not in retired])
    outcome = Recovery(int(membership.generation), list(membership.addresses), [a for a in gone if a not in retired],
                       [], NO_COMMIT, time.monotonic() - start, action="reinstalled",
                       left=[a for a in gone if a in retired], members_before=list(members_before),
                       reason=f"{type(error).__name__}: {error}")
    _announce(group, outcome)
    return outcome, failures


def grow(group: ReplicaGroup, options: ElasticOptions, install_newcomer: Any) -> Recovery | None:
    """At a commit boundary: admit the cluster's free workers (up to ``max_replicas``); ``None`` if none.

    Nothing is rolled back: every member already holds the newest commit,
    which the newcomers receive from a survivor.
    """
    free = free_workers(group, options)
    room = options.max_replicas - group.size if options.max_replicas is not None else len(free)
    if not free or room <= 0:
        return None
    start = time.monotonic()
    before = list(group.addresses)
    admitted = admit(group, free[:room])
    commit, healed = _restore_common_commit(group, admitted, install_newcomer)
    outcome = Recovery(int(group.generation), list(group.addresses), [], admitted, commit,
                       time.monotonic() - start, healed, action="grew", members_before=before,
                       reason=f"admitting free workers {', '.join(admitted)}")
    _announce(group, outcome)
    return outcome


def refill(group: ReplicaGroup, options: ElasticOptions, install_newcomer: Any) -> Recovery | None:
    """Before a ``fit``: a group below ``min_replicas`` (an earlier run ended in that error) waits for workers.

    ``None`` when the group has ``min_replicas`` members. Else free workers are
    admitted as they come, for up to ``wait_timeout``, and every member goes
    to the newest commit the old members hold (where the run that lost the
    workers would have gone back to), the newcomers getting it from a survivor.

    Raises
    ------
    ReplicaLostError
        No worker came within ``wait_timeout`` (naming the workers lost), as when the loss happened.
    """
    if group.size >= options.min_replicas:
        return None
    start = time.monotonic()
    before = list(group.addresses)
    lost = [a for a in quarantine_of(group).lost if a not in before]
    admitted = _wait_for_members(group, options, lost, can_admit=True)
    commit, healed = _restore_common_commit(group, admitted, install_newcomer)
    outcome = Recovery(int(group.generation), list(group.addresses), [], admitted, commit,
                       time.monotonic() - start, healed, action="grew", members_before=before,
                       reason=f"below min_replicas={options.min_replicas}: admitting {', '.join(admitted)}")
    _announce(group, outcome)
    return outcome


def leave(group: ReplicaGroup, options: ElasticOptions, install_newcomer: Any = None) -> Recovery | None:
    """At the commit the group stopped at: re-form it without its retiring members; ``None`` if none retire.

    Nothing is rolled back: every member holds that commit, which is their
    current state (the restore only checks that their digests agree). Below
    ``min_replicas`` free workers are admitted as after a loss.
    """
    before = list(group.addresses)
    start = time.monotonic()
    membership = group.let_retiring_leave()
    left = [a for a in before if a not in membership.addresses]
    if not left:
        return None
    admitted: list[str] = []
    if membership.size < options.min_replicas:
        admitted = _wait_for_members(group, options, left, install_newcomer is not None)
        membership = group.membership
    commit, healed = _restore_common_commit(group, admitted, install_newcomer)
    outcome = Recovery(int(membership.generation), list(membership.addresses), [], admitted, commit,
                       time.monotonic() - start, healed, action="left", left=left, members_before=before,
                       reason=f"retiring {', '.join(left)} (graceful: no rollback)")
    _announce(group, outcome)
    return outcome


def _retired(group: ReplicaGroup) -> set[str]:
    """The members that left the group gracefully (retired: ``group.departures``), as the scheduler knows."""
    try:
        return set(group.scheduler_view().retired)
    except Exception:
        return set()


def _departures(group: ReplicaGroup, before: list[str]) -> tuple[list[str], set[str]] | None:
    """The members of ``before`` the scheduler no longer lists, and the retired ones among all (``None``: unknown)."""
    try:
        view = group.scheduler_view()
    except Exception:
        return None
    return view.departed(before), set(view.retired)


def _only_retired(group: ReplicaGroup, before: list[str]) -> bool:
    """Whether the group moved on only because members retired (no failure): every member gone retired."""
    departures = _departures(group, before)
    if departures is None:
        return False
    gone, retired = departures
    return bool(gone) and set(gone) <= retired


def _failed_members(group: ReplicaGroup, error: BaseException, before: list[str]) -> list[str]:
    """The workers whose loss ``error`` reports: its ``worker``, else the members of ``before`` lost unretired."""
    if getattr(error, "worker", None):
        return [error.worker]  # type: ignore[attr-defined]
    departures = _departures(group, before)  # e.g. a command rejected because the group moved on after a loss
    if departures is None:
        return []
    gone, retired = departures
    return [a for a in gone if a not in retired]


def _next_generation(group: ReplicaGroup, before: Membership, timeout: float, error: BaseException) -> Membership:
    """Wait for the scheduler to announce a generation newer than ``before``."""
    membership = group.wait_for_generation(before.generation, timeout)
    if membership is None:
        raise ElasticRecoveryError(
            f"{type(error).__name__} ({error}) but the scheduler announced no new membership for "
            f"{group.group_id} within {timeout:g} s, so it is not a loss the group can recover from"
        ) from error
    return membership


def _wait_for_members(group: ReplicaGroup, options: ElasticOptions, lost: list[str], can_admit: bool) -> list[str]:
    """Below ``min_replicas``: admit free Dask workers as they come, for up to ``wait_timeout``."""
    deadline = time.monotonic() + options.wait_seconds
    admitted: list[str] = []
    seen = group.cluster_changes()
    while group.size < options.min_replicas:
        free = [] if not can_admit else free_workers(group, options)
        room = options.max_replicas - group.size if options.max_replicas is not None else len(free)
        if free and room > 0:
            admitted += admit(group, free[:room])
            continue
        if time.monotonic() >= deadline:
            raise ElasticRecoveryError(
                f"the elastic group {group.group_id} lost {', '.join(lost) or 'members'} and has "
                f"{group.size} replicas, fewer than min_replicas={options.min_replicas}; no worker came within "
                f"wait_timeout ({options.wait_seconds:g} s)", worker=lost[0] if lost else None)
        seen = group.wait_for_cluster_change(seen, min(1.0, max(deadline - time.monotonic(), 0.0)))
    return admitted


def remember_members(group: ReplicaGroup) -> None:
    """Note the Dask names of the cluster's workers, so that a member lost later is known by its name."""
    quarantine_of(group).remember(scheduler_workers(group.client))


def free_workers(group: ReplicaGroup, options: ElasticOptions) -> list[str]:
    """Workers of the cluster that host no member of the group, oldest first, but those in their cooldown and
    those leaving (retired from the group, or closing)."""
    workers = scheduler_workers(group.client)
    quarantine = quarantine_of(group)
    quarantine.remember(workers)
    members = set(group.addresses)
    free = [a for a in workers if a not in members and workers[a].get("status", "running") == "running"]
    if free:  # a member that just retired is still in the cluster while Dask closes it: it is not free
        retired = _retired(group)
        free = [a for a in free if a not in retired]
    cooling = [a for a in free if quarantine.cooling(a, options.cooldown_seconds)]
    if cooling:
        logger.info("Not admitting %s into %s: they failed less than cooldown=%s ago", cooling, group.group_id,
                    options.cooldown)
    return [a for a in free if a not in cooling]


def admit(group: ReplicaGroup, newcomers: list[str]) -> list[str]:
    """Add ``newcomers`` to the group in a new generation and start a replica on each (at a commit boundary).

    Their replicas meet the others at the first command of the new generation.
    """
    group.admit(newcomers)
    return list(newcomers)


def _restore_common_commit(group: ReplicaGroup, admitted: list[str], install_newcomer: Any) -> tuple[CommitKey, bool]:
    """Every member back at the newest commit all the old members hold; newcomers get it from a survivor."""
    newcomers: list[int] = [group.membership.rank_of(a) for a in admitted]
    old = [r for r in range(group.size) if r not in newcomers]
    held = group.call(commit_keys, ranks=old)
    # a member holding no commit was admitted but never given the state (a loss cut its admission short): it
    # is a newcomer, never asked to restore what it was not given
    unseeded = [r for r, keys in zip(old, held) if not keys]
    if unseeded and len(unseeded) < len(old):
        logger.info("Members %s of %s hold no commit (admitted, never given the state): admitting them as "
                    "newcomers", unseeded, group.group_id)
        newcomers += unseeded
        held = [keys for r, keys in zip(old, held) if r not in unseeded]
        old = [r for r in old if r not in unseeded]
    common = set.intersection(*(set(map(tuple, keys)) for keys in held)) if held else set()
    if not common:
        raise ElasticRecoveryError(f"the survivors of {group.group_id} hold no common commit (held: {held}); "
                                   "their state cannot be made consistent")
    key: CommitKey = max(common)
    missing = group.call(missing_residents, (key,), ranks=old)
    lacking = [r for r, m in zip(old, missing) if m]
    if lacking and len(lacking) < len(old):  # a member that lacks what the commit restores gets it as a newcomer
        logger.info("Members %s of %s lack residents of commit %s (%s): admitting them as newcomers", lacking,
                    group.group_id, key, [m for m in missing if m][0])
        newcomers += lacking
        old = [r for r in old if r not in lacking]
    digests = group.call(restore_commit, (key,), ranks=old)
    healed = False
    if len(set(digests)) > 1 or newcomers:
        source = old[0]
        commit = group.call(commit_state, (key,), member=source)[0]
        for rank in newcomers:
            install_newcomer(rank)
        skips = _not_given(group, newcomers, commit)
        targets = [r for r, d in zip(old, digests) if d != digests[0]] + newcomers
        healed = len(set(digests)) > 1
        if healed:
            logger.warning("Replicas %s of %s held a different state at commit %s: healed from replica %d",
                           targets, group.group_id, key, source)
        fixed = group.call(install_commit, [(commit, skips.get(r, [])) for r in range(group.size)], ranks=targets)
        digests = [digests[0]] + list(fixed)
    if len(set(digests)) != 1:
        raise ElasticRecoveryError(f"the members of {group.group_id} hold different states after restoring {key}")
    return key, healed


def _not_given(group: ReplicaGroup, newcomers: list[int], commit: Any) -> dict[int, list[tuple[str, str]]]:
    """The residents of ``commit`` each newcomer was not given (``install_newcomer`` gives what the trainer
    trains; a custom loop's optimizer or metric copy is made again where it is next used): left out of its
    restore, so the newcomer gets the commit of what it holds instead of failing the restore."""
    if not newcomers:
        return {}
    lacking = group.call(lacking_residents, (commit.resident_keys(),), ranks=newcomers)
    skips = {rank: [tuple(k) for k in keys] for rank, keys in zip(newcomers, lacking) if keys}
    if skips:
        logger.warning("Newcomers of %s were not given residents of commit %s (%s): not restored there", group.group_id,
                       commit.key, skips)
    return skips


def recover_within_budget(group: ReplicaGroup, options: ElasticOptions, error: BaseException, failures: int,
                          install_newcomer: Any = None) -> tuple[Recovery, int]:
    """``recover`` from ``error``, again after each further loss, each loss counted against ``max_failures``.

    Returns the outcome (``lost``: every member lost since ``error``, also
    during the recovery) and the new failure count. Raises
    ``ReplicaLostError`` when the budget is exhausted, and what ``is_final``
    says cannot be recovered from.
    """
    if is_final(error):  # the end of an elastic run is never recovered from (it reached the caller's loop again)
        raise error
    before = list(group.addresses)
    while True:  # a second loss during a recovery starts it again, on the members left
        if not _only_retired(group, list(group.addresses)):
            failures += 1
        if 0 <= options.max_failures < failures:
            quarantine_of(group).failed(_failed_members(group, error, before))
            raise ElasticRecoveryError(
                f"{error} (the strategy's elastic max_failures={options.max_failures} is exhausted; workers lost: "
                f"{quarantine_of(group).describe() or 'none known'})",
                worker=getattr(error, "worker", None)) from error
        logger.warning("Elastic training: %s; recovering", error)
        try:
            outcome = recover(group, options, error, install_newcomer=install_newcomer, members_before=before)
            break
        except RECOVERABLE as again:
            if is_final(again):
                raise
            error = again
    return outcome, failures
