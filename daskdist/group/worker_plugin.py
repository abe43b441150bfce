"""The worker side: where replica runtimes live and how messages reach them.

Installed on every current and future worker by the scheduler plugin. Holds
the replicas running on this worker (``worker.extensions["daskdist"]``, one
per group) and registers the handlers peers and the client use. Every
message carries its group's generation: one of an older generation than the
replica's is rejected (the client's commands get a ``StaleGenerationError``
message back; peers' data and aborts are dropped), never consumed. Handlers
never raise across the wire; unknown groups get an error message or are
dropped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from distributed.diagnostics.plugin import WorkerPlugin

from daskdist import serialization
from daskdist.exceptions import ReplicaLostError, StaleGenerationError
from daskdist.group.membership import Membership, check_generation

if TYPE_CHECKING:
    import asyncio

    from distributed import Worker

__all__ = ["DaskdistWorkerPlugin", "HostedMember", "HostedReplica"]

logger = logging.getLogger(__name__)

_HANDLERS = ("daskdist_call", "daskdist_message", "daskdist_abort", "daskdist_status", "daskdist_stop",
             "daskdist_host_member")


class HostedReplica(Protocol):
    """What the worker plugin needs of a replica it hosts (``ReplicaRuntime`` implements it)."""

    group_id: str
    rank: int
    generation: int
    known_generation: int

    def submit(self, run_id: int, payload: bytes, generation: int, settings: dict[str, Any] | None) -> asyncio.Future[dict[str, Any]]: ...

    def deliver(self, generation: int, tag: tuple[Any, ...], payload: Any) -> None: ...

    def abort_run(self, generation: int, run_id: int | None, abort: dict[str, Any],
                  attempt: int | None = None) -> None: ...

    def abort_group(self, message: str, generation: int | None = None) -> None: ...

    def new_generation(self, membership: Membership) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...


class HostedMember(Protocol):
    """A member that is not a replica (a parameter store): what the worker plugin needs of it."""

    def info(self) -> dict[str, Any]: ...

    def abort_group(self, message: str) -> None: ...

    def stop(self) -> None: ...


class DaskdistWorkerPlugin(WorkerPlugin):
    """Worker extension holding this worker's replicas, keyed by group id (one replica per group here)."""

    name = "daskdist"
    idempotent = True

    def __init__(self) -> None:
        self.replicas: dict[str, HostedReplica] = {}
        #: this worker's members of other roles (parameter stores), keyed by group id
        self.members: dict[str, HostedMember] = {}
        self.worker: Worker | None = None
        #: per group, the members retiring: the replicas stop at their next commit (``retiring``)
        self.leaving: dict[str, set[str]] = {}

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        worker.handlers.update(
            {
                "daskdist_call": self.call,
                "daskdist_message": self.message,
                "daskdist_abort": self.abort_run,
                "daskdist_status": self.status,
                "daskdist_stop": self.stop,
                "daskdist_host_member": self.host_member,
            }
        )
        worker.stream_handlers.update(
            {
                "daskdist_abort_group": self.abort_group,
                "daskdist_close_group": self.close_group,
                "daskdist_new_generation": self.new_generation,
                "daskdist_leave": self.leave,
            }
        )
        worker.extensions["daskdist"] = self

    def teardown(self, worker: Worker) -> None:
        for runtime in list(self.replicas.values()):
            runtime.abort_group(f"worker {worker.address} is closing")
            runtime.stop()
        self.replicas.clear()
        for member in list(self.members.values()):
            member.stop()
        self.members.clear()
        for name in _HANDLERS:
            worker.handlers.pop(name, None)
        # stream handlers stay: the scheduler may still send aborts while this worker closes, and an
        # unknown op would break the worker's stream; with no replicas left they do nothing
        worker.extensions.pop("daskdist", None)

    # -- registry used by replica tasks ------------------------------------------

    def add_replica(self, runtime: HostedReplica) -> None:
        if runtime.group_id in self.replicas:
            raise RuntimeError(f"worker {self._address} already hosts a replica of {runtime.group_id}")
        self.replicas[runtime.group_id] = runtime

    def remove_replica(self, runtime: HostedReplica) -> None:
        if self.replicas.get(runtime.group_id) is runtime:
            del self.replicas[runtime.group_id]

    @property
    def _address(self) -> str:
        return self.worker.address if self.worker else "?"

    # -- handlers ----------------------------------------------------------------

    async def call(self, group_id: str, rank: int, run_id: int, payload: bytes, generation: int = 0,
                   settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run a command on this worker's replica of ``group_id`` (from the client); answer OK or an error message."""
        runtime = self.replicas.get(group_id)
        if runtime is None:
            error: Exception = ReplicaLostError(
                f"replica {rank} of {group_id} is not running on worker {self._address} "
                "(its worker restarted, or the strategy was closed)",
                worker=self._address,
            )
            return serialization.error_message(error, rank, self._address)
        try:
            check_generation(group_id, runtime.known_generation, generation, f"a command (run {run_id})")
        except StaleGenerationError as e:
            return serialization.error_message(e, rank, self._address)
        response: dict[str, Any] = await runtime.submit(run_id, payload, generation, settings)
        return response

    def message(self, group_id: str, rank: int, tag: list[Any], payload: Any, generation: int = 0) -> None:
        """Deliver a collective payload from a peer to the replica's mailbox of ``generation``."""
        runtime = self.replicas.get(group_id)
        if runtime is None:
            logger.debug("Dropping message %s for unknown replica %s/%d", tag, group_id, rank)
            return
        runtime.deliver(generation, tuple(tag), payload)

    def abort_run(self, group_id: str, rank: int, run_id: int | None, abort: dict[str, Any],
                  generation: int = 0, attempt: int | None = None) -> None:
        """A peer failed in ``attempt`` of the process group, or the client aborted ``run_id``: fail those waits.

        ``attempt=None`` and ``run_id=None``: a peer's transport lost another
        replica; the generation is lost here too.
        """
        runtime = self.replicas.get(group_id)
        if runtime is not None:
            runtime.abort_run(generation, run_id, abort, attempt)

    def status(self, group_id: str, rank: int) -> dict[str, Any] | None:
        """Where the replica is (run, collective number, state, generation), for timeout diagnostics."""
        runtime = self.replicas.get(group_id)
        return runtime.status() if runtime is not None else None

    def stop(self, group_id: str, rank: int) -> dict[str, Any]:
        """Ask the replica (or the member of another role) to finish (the strategy is closing)."""
        runtime = self.replicas.get(group_id)
        if runtime is not None:
            runtime.stop()
        self._stop_member(group_id)
        return {"status": "OK"}

    async def host_member(self, group_id: str, rank: int, role: str, factory: bytes,
                          generation: int = 0) -> dict[str, Any]:
        """Start this worker's member of ``group_id`` with role ``role`` and meet the group's rendezvous.

        ``factory``: a pickled callable ``factory(worker) -> HostedMember``
        (a parameter store: ``daskdist.ps.members.start_store_member``). The
        member's ``info()`` is its rendezvous info. Answers ``{"status": "OK",
        "info": ...}`` once every member has arrived, or an error message
        (never raises across the wire).
        """
        if self.worker is None:
            return {"status": "error", "message": "the daskdist worker plugin is not set up"}
        try:
            if group_id in self.members:
                raise RuntimeError(f"worker {self._address} already hosts a member of {group_id}")
            member: HostedMember = serialization.loads(factory)(self.worker)
            info = member.info()
        except Exception as e:  # noqa: BLE001 - answered with the error
            return serialization.error_message(e, rank, self._address)
        self.members[group_id] = member
        logger.debug("Worker %s hosts member %d (%s) of %s", self._address, rank, role, group_id)
        scheduler: Any = self.worker.scheduler
        answer: dict[str, Any] = await scheduler.daskdist_rendezvous(group_id=group_id, rank=rank,
                                                                     address=self._address, info=info,
                                                                     generation=generation)
        if answer.get("status") != "OK":
            self._stop_member(group_id)
            return {"status": "error", "message": answer.get("message", f"the rendezvous of {group_id} failed")}
        return {"status": "OK", "info": info}

    def _stop_member(self, group_id: str) -> None:
        member = self.members.pop(group_id, None)
        if member is not None:
            member.stop()

    # -- stream handlers (from the scheduler plugin) -------------------------------

    def abort_group(self, group_id: str, message: str, worker: str | None = None,
                    generation: int | None = None) -> None:
        """A member of the group was lost: the replica here raises ``ReplicaLostError`` in that generation."""
        runtime = self.replicas.get(group_id)
        if runtime is not None:
            runtime.abort_group(message, generation)
        member = self.members.get(group_id)
        if member is not None:
            member.abort_group(message)

    def close_group(self, group_id: str, message: str = "") -> None:
        """The group's client went away: abort and stop the replica here."""
        runtime = self.replicas.get(group_id)
        if runtime is not None:
            runtime.abort_group(message or f"group {group_id} was closed")
            runtime.stop()
        self._stop_member(group_id)

    def new_generation(self, group_id: str, membership: dict[str, Any], message: str = "") -> None:
        """The scheduler moved the group to a new generation: the replica here re-forms at its next command."""
        runtime = self.replicas.get(group_id)
        self.leaving.pop(group_id, None)
        if runtime is not None:
            new = Membership.from_msg(membership)
            runtime.new_generation(new)
            if self._address not in new.addresses:  # it left (retired): nothing will come for it any more
                runtime.stop()

    def leave(self, group_id: str, workers: list[str]) -> None:
        """Members ``workers`` of ``group_id`` are retiring: the group stops at its next commit to let them go."""
        self.leaving.setdefault(group_id, set()).update(workers)

    def retiring(self, group_id: str) -> bool:
        """Whether members of ``group_id`` wait to leave it (read by the replicas at each commit)."""
        return bool(self.leaving.get(group_id))
