"""The replica side of elastic training: the commit ring and the commands the client sends.

Every replica keeps its two newest commits (``CommitRing``, resident kind
``commit``): a copy of its variables and models (weights, optimizer slots and
step counter, through the resident store's ``snapshot``) and the epoch's
progress at that step. Two, because a step's all-reduce can finish on some
replicas before a failure is noticed: those commit a step the others never
reach, and the survivors agree on the newest commit all of them hold.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree

from daskdist import fault_points
from daskdist.arrays import to_numpy
from daskdist.elastic.boundary import retiring
from daskdist.group.service import COMMIT, MODEL, VARIABLE, ReplicaService, ResidentStore

__all__ = [
    "Commit",
    "CommitKey",
    "CommitRing",
    "commit_keys",
    "commit_ring",
    "state_residents",
    "commit_now",
    "commit_progress",
    "commit_state",
    "install_commit",
    "lacking_residents",
    "restore_commit",
    "state_digest",
    "take_commit",
]

logger = logging.getLogger(__name__)

#: ``(fit, epoch, step)``: the ``fit`` call of the strategy, the epoch, the global batches of the epoch done.
CommitKey = tuple[int, int, int]
#: A snapshot of residents by ``(kind, id)`` (``ResidentStore.snapshot``).
ResidentStates = dict[tuple[str, str], Any]
_RING_ID = "ring"
STATE_KINDS = (VARIABLE, MODEL)


class Commit:
    """One committed state of one replica: its key, its state (``ResidentStore.snapshot(STATE_KINDS)``), the
    epoch's progress at that step (``{"loss_sum", "count", "metrics"}``).

    A commit taken during ``fit`` is copied by a background thread (``Commit.copying``) while the next step's
    input, forward and backward run; ``state`` waits for the copy. The replica waits for it before the next
    optimizer apply (``settle``), the only thing that changes what is being copied.
    """

    def __init__(self, key: CommitKey, state: ResidentStates, progress: dict[str, Any]):
        self.key = key
        self.progress = progress
        self._state: ResidentStates | None = state
        self._copy: concurrent.futures.Future[ResidentStates] | None = None

    @classmethod
    def copying(cls, key: CommitKey, objects: ResidentStore, progress: dict[str, Any],
                before_copy: Callable[[], None] | None = None,
                copier: concurrent.futures.Executor | None = None) -> Commit:
        """A commit whose state ``objects`` (a ``ResidentStore``) is copied by another thread.

        ``copier``: the thread that copies (the ring's ``CommitRing.copier``: its thread waits for copies, so a
        commit starts none); ``None``: a thread started now. ``before_copy``: called first in that thread (a
        test's fault point, ``fault_points.bound``).
        What the next step's forward changes before its apply is taken here, on the step path: the models'
        random states (``snapshot_random``), or all of it for a model resident with ``begin_snapshot(into)``
        (random states and moving statistics), which returns the function the thread copies the rest with.
        """
        commit = cls(key, {}, progress)
        commit._state = None
        future: concurrent.futures.Future[ResidentStates] = concurrent.futures.Future()
        random = _random_states_now(objects)  # the next step's forward draws from them while the copy runs
        prepared = _prepare_copies(objects)
        held = objects.held()  # the residents at the commit (the next command may install others meanwhile)

        def copy() -> None:
            try:
                if before_copy is not None:
                    before_copy()
                state = _copy_state(objects, prepared, held)
                future.set_result(_with_random_states(state, random))
            except BaseException as e:  # the replica raises it at its next settle or restore
                future.set_exception(e)

        commit._copy = future
        if copier is not None:
            copier.submit(copy)
        else:
            threading.Thread(target=copy, name=f"daskdist-commit-{key}", daemon=True).start()
        return commit

    @property
    def state(self) -> ResidentStates:
        if self._state is None:
            assert self._copy is not None
            self._state = self._copy.result()
            self._copy = None
        return self._state

    @property
    def copied(self) -> bool:
        """Whether the state is copied (``state`` would not wait)."""
        return self._copy is None or self._copy.done()

    @property
    def settled(self) -> bool:
        """Whether ``settle`` returned already (it returns at once and raises nothing from now on)."""
        return self._copy is None

    def settle(self) -> None:
        """Wait until the state is copied (raises what the copy raised)."""
        self.state  # noqa: B018 (waits for the copy)

    def resident_keys(self) -> list[tuple[str, str]]:
        """The ``(kind, id)`` of the residents this commit restores."""
        return list(self.state)

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "state": self.state, "progress": self.progress}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["key"], state["state"], state["progress"])  # type: ignore[misc]


def _random_states_now(objects: ResidentStore) -> ResidentStates:
    """The models' random generator states at the commit (``snapshot_random``), read on the step path.

    The weights cannot change before the next apply (which waits for the copy), but the next forward
    (a dropout) draws from the generators at once: their state is taken before the copy thread starts.
    """
    out: ResidentStates = {}
    for model_id in objects.ids(MODEL):
        resident = objects.get(MODEL, model_id)
        if hasattr(resident, "snapshot_random"):
            out[(MODEL, model_id)] = resident.snapshot_random()
    return out


def _prepare_copies(objects: ResidentStore) -> dict[tuple[str, str], Callable[[], Any]]:
    """The model residents' ``begin_snapshot()``, called on the step path: the functions that end their copies."""
    out = {}
    for model_id in objects.ids(MODEL):
        resident = objects.get(MODEL, model_id)
        if hasattr(resident, "begin_snapshot"):
            out[(MODEL, model_id)] = resident.begin_snapshot()
    return out


def _copy_state(objects: ResidentStore, prepared: dict[tuple[str, str], Callable[[], Any]] | None = None,
                held: dict[tuple[str, str], Any] | None = None) -> ResidentStates:
    """The copy a commit keeps: the replica's variables and models (``ResidentStore.snapshot``); the residents
    in ``prepared`` copied by the function their ``begin_snapshot`` returned; ``held``: those at the commit."""
    state: ResidentStates = objects.snapshot(STATE_KINDS, prepared, held)
    return state


def _with_random_states(state: ResidentStates, random: ResidentStates) -> ResidentStates:
    """``state`` with the models' random states taken at the commit (``random``) in place of those copied."""
    for key, states in random.items():
        if key in state:
            state[key]["rng"] = states
    return state


class CommitRing:
    """A replica's newest commits, oldest first (``keep`` of them).

    Attributes
    ----------
    copier
        The replica's thread that copies commits off the step's path (``Commit.copying``), started at its first
        copy and kept: starting a thread per copy waits until the OS runs it, which on a busy host is
        milliseconds of the step's path.
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.commits: OrderedDict[CommitKey, Commit] = OrderedDict()
        self.copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="daskdist-commit")
        self._settled = True  # every commit held was settled (``settle`` has nothing to wait for)

    def add(self, commit: Commit) -> None:
        self.commits[commit.key] = commit
        if not commit.settled:
            self._settled = False
        while len(self.commits) > self.keep:
            self.commits.popitem(last=False)

    def get(self, key: CommitKey) -> Commit:
        try:
            return self.commits[tuple(key)]  # type: ignore[index]
        except KeyError:
            raise KeyError(f"no commit {tuple(key)} here (held: {list(self.commits)})") from None

    def settle(self) -> None:
        """Wait until every commit's copy is done (before anything changes the state they copy); raises what a
        copy raised."""
        if self._settled:
            return
        for commit in list(self.commits.values()):
            commit.settle()
        self._settled = True

    def drop_after(self, key: CommitKey) -> None:
        """Forget commits newer than ``key`` (their steps are replayed)."""
        for newer in [k for k in self.commits if k > tuple(key)]:
            del self.commits[newer]


def commit_ring(service: ReplicaService) -> CommitRing:
    """The replica's ``CommitRing`` (made at its first use)."""
    ring = service.objects.find(COMMIT, _RING_ID)
    if ring is None:
        ring = CommitRing()
        service.objects.install(COMMIT, _RING_ID, ring)
    return ring


def state_digest(state: ResidentStates) -> str:
    """A hash of a snapshot's bytes (keys, dtypes, shapes and values), to check replicas hold the same state."""
    digest = hashlib.sha256()
    for key in sorted(state, key=repr):
        digest.update(repr(key).encode())
        for leaf in optree.tree_leaves(state[key], none_is_leaf=True):
            if hasattr(leaf, "digest_bytes"):  # a leaf that says what of it must agree (random states: nothing)
                digest.update(leaf.digest_bytes())
                continue
            array = np.ascontiguousarray(to_numpy(leaf)) if hasattr(leaf, "shape") else np.asarray(leaf)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


# -- commands (``command(service, *args)``) ------------------------------------------------


def take_commit(service: ReplicaService, model_id: str, key: CommitKey, input_shape: tuple[int, ...] | None,
                dtype: str | None) -> None:
    """Commit the state as it is (before a ``fit``'s first step), building the model first if it is not.

    A model is built at its first batch from replica 0's initial weights; a
    commit of an unbuilt model could not be restored once it is built, so it
    is built here, the same way (``input_shape`` of ``x``, without the batch).
    """
    service.objects.get(MODEL, model_id).model.build_as_first_batch(input_shape, dtype)  # raises without a shape
    commit_ring(service).add(Commit(tuple(key), service.objects.snapshot(STATE_KINDS),  # type: ignore[arg-type]
                              {"loss_sum": 0.0, "count": 0.0, "metrics": {}}))


def commit_now(service: ReplicaService, key: CommitKey) -> bool:
    """Commit the replica's variables and models as they are (``dd.elastic.State.commit``).

    The copy runs off the step path (``Commit.copying``) when every resident it covers guards it: a
    resident with ``guard_copy(settle)`` that returns ``True`` calls ``settle`` before it next writes what
    the copy reads (a ``TorchModel`` whose loop was seen to change its weights only in ``optimizer.step()``:
    its optimizer's step, its next DDP wrapper, a restore). Else (a variable, a built-in model: the next
    command may change anything) the copy is made before the reply.

    Returns whether the scheduler said members are retiring (the loop lets them leave at this commit).
    """
    progress: dict[str, Any] = {"loss_sum": 0.0, "count": 0.0, "metrics": {}}
    residents = [service.objects.get(*k) for k in state_residents(service)]
    commit: Commit
    if residents and all(callable(getattr(r, "guard_copy", None)) for r in residents):
        commit = Commit.copying(tuple(key), service.objects, progress,  # type: ignore[arg-type]
                                fault_points.state_copying(service.rank, key[1]))
        guarded = [r.guard_copy(commit.settle) for r in residents]
        if not all(guarded):  # one cannot hold its writes back: the copy is waited for here
            commit.settle()
    else:
        commit = Commit(tuple(key), service.objects.snapshot(STATE_KINDS), progress)  # type: ignore[arg-type]
    commit_ring(service).add(commit)
    fault_points.state_committed(service.rank, key[1])  # a test's fault point: committed, not yet answered
    return retiring(service)


def state_residents(service: ReplicaService) -> list[tuple[str, str]]:
    """The ``(kind, id)`` of every resident a commit covers (variables, models) on this replica."""
    return [(kind, object_id) for kind in STATE_KINDS for object_id in service.objects.ids(kind)]


def commit_progress(service: ReplicaService, key: CommitKey) -> dict[str, Any]:
    """The epoch's progress at commit ``key`` (global loss sum and examples, metric totals)."""
    return commit_ring(service).get(key).progress


def commit_keys(service: ReplicaService) -> list[CommitKey]:
    """The commits this replica holds, oldest first."""
    return list(commit_ring(service).commits)


def restore_commit(service: ReplicaService, key: CommitKey) -> str:
    """Go back to commit ``key``: restore its state, forget newer commits; returns the state's digest."""
    ring = commit_ring(service)
    ring.settle()  # no copy may read what the restore writes
    commit = ring.get(key)
    service.objects.restore(commit.state)
    if fault_points.ARMED:  # a test's fault point (``daskdist.testing.pause-at``): restored, not yet answered
        fault_points.restoring(service.rank, commit.key[2])
    ring.drop_after(key)
    _restore_metrics(service, commit.progress)
    return state_digest(commit.state)


def missing_residents(service: ReplicaService, key: CommitKey) -> list[tuple[str, str]]:
    """The residents commit ``key`` restores that this replica does not hold (it cannot restore it then)."""
    return [k for k in commit_ring(service).get(key).resident_keys() if service.objects.find(*k) is None]


def commit_state(service: ReplicaService, key: CommitKey) -> Commit:
    """This replica's commit ``key`` (to heal a replica whose copy differs, or a newcomer)."""
    return commit_ring(service).get(key)


def lacking_residents(service: ReplicaService, keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Which of the residents ``keys`` (a commit's) this replica does not hold."""
    return [(kind, object_id) for kind, object_id in keys if (kind, object_id) not in service.objects]


def install_commit(service: ReplicaService, commit: Commit, skip: Sequence[tuple[str, str]] = ()) -> str:
    """Take ``commit`` from another replica: restore it and keep it as this replica's newest commit.

    ``skip``: residents of the commit a newcomer was not given (its trainer installs only what it trains);
    they are left out of the restore (the digest returned is the whole commit's).
    """
    ring = commit_ring(service)
    ring.settle()
    skipped = {tuple(key) for key in skip}
    service.objects.restore({key: value for key, value in commit.state.items() if key not in skipped})
    if fault_points.ARMED:
        fault_points.restoring(service.rank, commit.key[2])
    ring.drop_after(commit.key)
    ring.add(commit)
    _restore_metrics(service, commit.progress)
    return state_digest(commit.state)


def _restore_metrics(service: ReplicaService, progress: dict[str, Any]) -> None:
    """The epoch's metric totals at the commit: all of them on rank 0, zeros elsewhere (they are summed later)."""
    for model_id in service.objects.ids(MODEL):
        totals = progress.get("metrics", {}).get(model_id)
        if totals is None:  # no metrics at this commit (a custom loop's, or a model of another framework)
            continue
        model = service.objects.get(MODEL, model_id).model
        for metric, total in zip(model.compiled_metrics, totals):
            total = np.asarray(total, np.float64)
            metric.set_totals(total if service.rank == 0 else np.zeros_like(total))


