"""The worker side: where replica runtimes live and how messages reach them.

Installed on every current and future worker by the scheduler plugin. Holds
the replicas running on this worker (``worker.extensions["daskdist"]``) and
registers the handlers peers and the client use. Handlers never raise
across the wire; unknown groups get an error message or are dropped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

from daskdist import serialization
from daskdist.collective.mailbox import Abort
from daskdist.exceptions import ReplicaLostError

if TYPE_CHECKING:
    from distributed import Worker

    from daskdist.replica.runtime import ReplicaRuntime

__all__ = ["DaskdistWorkerPlugin"]

logger = logging.getLogger(__name__)

_HANDLERS = ("daskdist_call", "daskdist_message", "daskdist_abort", "daskdist_status", "daskdist_stop")


class DaskdistWorkerPlugin(WorkerPlugin):
    """Worker extension holding this worker's replicas, keyed by ``(group_id, rank)``."""

    name = "daskdist"
    idempotent = True

    def __init__(self) -> None:
        self.replicas: dict[tuple[str, int], ReplicaRuntime] = {}
        self.worker: Worker | None = None

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        worker.handlers.update(
            {
                "daskdist_call": self.call,
                "daskdist_message": self.message,
                "daskdist_abort": self.abort_run,
                "daskdist_status": self.status,
                "daskdist_stop": self.stop,
            }
        )
        worker.stream_handlers.update(
            {"daskdist_abort_group": self.abort_group, "daskdist_close_group": self.close_group}
        )
        worker.extensions["daskdist"] = self

    def teardown(self, worker: Worker) -> None:
        for runtime in list(self.replicas.values()):
            runtime.abort_group(Abort("lost", f"worker {worker.address} is closing", None))
            runtime.stop()
        self.replicas.clear()
        for name in _HANDLERS:
            worker.handlers.pop(name, None)
        # stream handlers stay: the scheduler may still send aborts while this worker closes, and an
        # unknown op would break the worker's stream; with no replicas left they do nothing
        worker.extensions.pop("daskdist", None)

    # -- registry used by replica tasks ------------------------------------------

    def add_replica(self, runtime: ReplicaRuntime) -> None:
        self.replicas[(runtime.token, runtime.rank)] = runtime

    def remove_replica(self, runtime: ReplicaRuntime) -> None:
        self.replicas.pop((runtime.token, runtime.rank), None)

    def _group(self, group_id: str) -> list[ReplicaRuntime]:
        return [r for (g, _), r in self.replicas.items() if g == group_id]

    # -- handlers ----------------------------------------------------------------

    async def call(self, group_id: str, rank: int, run_id: int, payload: bytes) -> dict:
        """Run a command on replica ``rank`` (from the client); answer OK or an error message."""
        runtime = self.replicas.get((group_id, rank))
        if runtime is None:
            address = self.worker.address if self.worker else "?"
            error = ReplicaLostError(
                f"replica {rank} of {group_id} is not running on worker {address} "
                "(its worker restarted, or the strategy was closed)",
                worker=address,
            )
            return serialization.error_message(error, rank, address)
        return await runtime.submit(run_id, payload)

    def message(self, group_id: str, rank: int, tag: list, payload: Any) -> None:
        """Deliver a collective payload from a peer to replica ``rank``'s mailbox."""
        runtime = self.replicas.get((group_id, rank))
        if runtime is None:
            logger.debug("Dropping message %s for unknown replica %s/%d", tag, group_id, rank)
            return
        runtime.mailbox.put(tuple(tag), payload)

    def abort_run(self, group_id: str, rank: int, run_id: int | None, abort: dict) -> None:
        """A peer failed during ``run_id``: fail this replica's waits in that run (``None``: the group, for good)."""
        runtime = self.replicas.get((group_id, rank))
        if runtime is None:
            return
        if run_id is None:  # a peer's transport lost another replica (ReplicaRuntime.peer_lost)
            runtime.abort_group(Abort.from_msg(abort))
        else:
            runtime.mailbox.abort_run(run_id, Abort.from_msg(abort))

    def status(self, group_id: str, rank: int) -> dict | None:
        """Where replica ``rank`` is (run, collective number, state), for timeout diagnostics."""
        runtime = self.replicas.get((group_id, rank))
        return runtime.status() if runtime is not None else None

    def stop(self, group_id: str, rank: int) -> dict:
        """Ask replica ``rank`` to finish (the strategy is closing)."""
        runtime = self.replicas.get((group_id, rank))
        if runtime is not None:
            runtime.stop()
        return {"status": "OK"}

    # -- stream handlers (from the scheduler plugin) -------------------------------

    def abort_group(self, group_id: str, message: str, worker: str | None = None) -> None:
        """A replica of the group was lost: every replica here raises ``ReplicaLostError``."""
        for runtime in self._group(group_id):
            runtime.abort_group(Abort("lost", message, None))

    def close_group(self, group_id: str, message: str = "") -> None:
        """The group's client went away: abort and stop its replicas here."""
        for runtime in self._group(group_id):
            runtime.abort_group(Abort("lost", message or f"group {group_id} was closed", None))
            runtime.stop()
