"""The replica service: what code running on a replica may use, and its store of resident objects.

``ReplicaService`` is the small typed protocol the worker-side runtime
implements (``daskdist.replica.runtime.ReplicaRuntime``); keras, data and
variables talk to a replica only through it. ``ResidentStore`` holds the
objects that live on a replica between commands (variables, models with their
optimizer state, dataset shards, iterators, the batches of a step) keyed by
``(kind, id)``. Residents that implement ``Resident`` can be snapshotted and
restored: that is what the elastic recovery and parameter-server placement
are made of. Residents outlive membership generations; what a generation
wires (transports, the communicator) does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from daskdist.group.membership import Generation, GroupId, Membership, Rank

__all__ = [
    "BATCH",
    "COMMIT",
    "DATASET",
    "ITERATOR",
    "KINDS",
    "MODEL",
    "SNAPSHOT_KINDS",
    "STRATEGY",
    "VARIABLE",
    "ReplicaService",
    "Resident",
    "ResidentStore",
    "StepClock",
    "restore_residents",
    "snapshot_residents",
]

VARIABLE = "variable"  #: a replica's copy of a distributed variable (optimizer slots included)
MODEL = "model"  #: an installed keras model with its optimizer
DATASET = "dataset"  #: a replica's shard of a distributed dataset
ITERATOR = "iterator"  #: a pass over a shard
BATCH = "batch"  #: one step's element of an iterator (transient: never snapshotted)
STRATEGY = "strategy"  #: what a strategy leaves on each replica (a multi-worker strategy's cluster resolver)
COMMIT = "commit"  #: elastic training's newest committed snapshots (never snapshotted themselves)

KINDS = (VARIABLE, MODEL, DATASET, ITERATOR, BATCH, STRATEGY, COMMIT)
#: What a snapshot covers by default, in restore order (a model's weights after the variables).
SNAPSHOT_KINDS = (VARIABLE, MODEL, DATASET, ITERATOR)


@runtime_checkable
class Resident(Protocol):
    """An object living on a replica whose state can be taken and put back."""

    def snapshot(self) -> Any:
        """A copy of this object's state (arrays copied: later updates do not change it)."""

    def restore(self, state: Any) -> None:
        """Put back a state from ``snapshot`` (of this object or of its twin on another replica)."""


class ResidentStore:
    """A replica's resident objects, keyed by ``(kind, id)``.

    Parameters
    ----------
    owner
        How the store names its replica in error messages.
    """

    def __init__(self, owner: str = "replica"):
        self._owner = owner
        self._objects: dict[tuple[str, str], Any] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._objects

    def install(self, kind: str, object_id: str, obj: Any) -> None:
        """Keep ``obj`` as ``(kind, object_id)``, replacing what was there."""
        if kind not in KINDS:
            raise ValueError(f"Unknown resident kind {kind!r}; expected one of {', '.join(KINDS)}")
        self._objects[(kind, object_id)] = obj

    def get(self, kind: str, object_id: str) -> Any:
        """The object installed as ``(kind, object_id)``; ``KeyError`` naming the replica if none."""
        try:
            return self._objects[(kind, object_id)]
        except KeyError:
            raise KeyError(f"{self._owner} holds no {kind} {object_id!r}") from None

    def find(self, kind: str, object_id: str) -> Any | None:
        """The object, or ``None``."""
        return self._objects.get((kind, object_id))

    def pop(self, kind: str, object_id: str) -> Any | None:
        """Remove and return the object (``None`` if there was none)."""
        return self._objects.pop((kind, object_id), None)

    def discard(self, kind: str, object_id: str) -> None:
        self._objects.pop((kind, object_id), None)

    def ids(self, kind: str) -> list[str]:
        """The ids of every object of ``kind``, in installation order."""
        return [i for k, i in self._objects if k == kind]

    def objects(self, kind: str) -> list[Any]:
        return [o for (k, _), o in self._objects.items() if k == kind]

    def clear(self) -> None:
        self._objects.clear()

    def snapshot(self, kinds: Iterable[str] = SNAPSHOT_KINDS,
                 begun: Mapping[tuple[str, str], Callable[[], Any]] | None = None,
                 held: Mapping[tuple[str, str], Any] | None = None) -> dict[tuple[str, str], Any]:
        """The state of every resident of ``kinds`` that implements ``Resident``, keyed like the store.

        ``begun``: for these keys, the function that ends a copy the resident began earlier (an elastic commit's
        ``begin_snapshot``, started on the step path) in place of its ``snapshot()``. ``held``: the residents
        to copy, as ``held()`` gave them when the copy began (a copy in another thread while the replica's
        commands install others), in place of those held now.
        """
        wanted = tuple(kinds)
        begun = begun or {}
        residents = self._objects if held is None else held
        return {
            key: begun[key]() if key in begun else obj.snapshot()
            for key, obj in residents.items()
            if key[0] in wanted and isinstance(obj, Resident)
        }

    def held(self) -> dict[tuple[str, str], Any]:
        """The residents held now, by key (a copy of the store's index, not of the objects)."""
        return dict(self._objects)

    def restore(self, states: dict[tuple[str, str], Any]) -> None:
        """Put back states from ``snapshot`` into the residents with the same keys.

        Raises
        ------
        KeyError
            A state names a resident this store does not hold (nothing is restored then).
        """
        missing = [key for key in states if key not in self._objects]
        if missing:
            raise KeyError(f"{self._owner} cannot restore {missing}: it holds no such residents")
        order = {kind: i for i, kind in enumerate(SNAPSHOT_KINDS)}
        for key in sorted(states, key=lambda k: order.get(k[0], len(order))):
            self._objects[key].restore(states[key])


class StepClock(Protocol):
    """The replica's step timer as code on the replica uses it (``daskdist.replica.timing.StepTimer`` implements it).

    The runtime opens a step around each function it runs; input iterators,
    collectives and variable updates add their time to the open step.
    """

    @property
    def history(self) -> Iterable[Any]:
        """The last finished steps' timings (``StepTiming``), oldest first."""

    def begin(self, run_id: int) -> None:
        """Open a step of run (or training step) ``run_id``."""

    def end(self, samples: int | None = None) -> Any:
        """Close the open step; its ``StepTiming`` (``samples``: the rows it processed, when known)."""

    def add_pending_input(self, seconds: float) -> None:
        """Input read before the step opened (a prefetch the step then waits on no longer)."""

    def add_input_wait(self, seconds: float) -> None:
        """Time the open step waited for its input."""

    def add_collective(self, kind: str, seconds: float, nbytes: int, key: tuple[int, int] | None = None) -> None:
        """One collective of the open step: its kind, duration, payload and identity in its group."""

    def add_apply(self, seconds: float) -> None:
        """Time the open step spent applying updates to variables."""

    def add_samples(self, samples: int) -> None:
        """Rows the open step processed."""


class ReplicaService(Protocol):
    """What commands, keras, data and variables may use of the replica they run on."""

    rank: Rank
    size: int
    generation: Generation
    #: The group this replica belongs to, and the client command it runs (-1 before the first).
    group_id: GroupId
    run_id: int
    membership: Membership
    strategy_token: str
    devices: list[str]
    objects: ResidentStore
    #: The Dask worker hosting the replica (its data: a shard reads its partitions from it).
    worker: Any
    #: The ``tf.distribute.Strategy`` seen from inside the replica (``ReplicaStrategyView``).
    strategy_view: Any

    @property
    def timer(self) -> StepClock:
        """The replica's step timer: the open step's input waits, collectives and updates go to it."""

    @property
    def token(self) -> str:
        """The strategy's identity (``strategy_token``), what pickled handles carry."""

    @property
    def context(self) -> Any:
        """This replica's ``ReplicaContext``."""

    @property
    def communicator(self) -> Any:
        """This generation's communicator (collectives)."""

    @property
    def mailbox(self) -> Any:
        """This generation's mailbox of tagged collective messages (its abort check)."""

    @property
    def process_group(self) -> Any:
        """This generation's process group: collectives go through it (sync or async, any thread)."""

    def log_event(self, topic: str, msg: Any) -> None:
        """Send a structured event to the scheduler (``Worker.log_event``)."""

    def add_close_callback(self, callback: Any) -> None:
        """Call ``callback()`` in the replica thread when the replica closes (strategy closed, or it left)."""

    def run_step(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``fn`` as one timed step."""

    def record_step(self, timing: Any) -> None:
        """Queue a finished step's timing for the scheduler."""

    def flush_step_events(self) -> None:
        """Send the queued step timings now."""


# -- commands (``command(service, *args)``, sent by the group handle) ---------------------------


def snapshot_residents(service: ReplicaService, kinds: tuple[str, ...] | None = None) -> dict[tuple[str, str], Any]:
    """The state of the replica's residents of ``kinds`` (default ``SNAPSHOT_KINDS``), arrays copied."""
    return service.objects.snapshot(SNAPSHOT_KINDS if kinds is None else kinds)


def restore_residents(service: ReplicaService, states: dict[tuple[str, str], Any]) -> None:
    """Put back ``snapshot_residents``'s states (this replica's or another's) into the replica's residents."""
    service.objects.restore(states)
