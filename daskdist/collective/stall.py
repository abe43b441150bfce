"""Where the peers are when a collective waits: timeout messages and stall warnings.

A replica waiting in one collective longer than
``daskdist.collective.stall-warning`` warns, naming the replicas that have not
joined (``StallWatch``); a collective that times out says the same in its
``CollectiveTimeoutError``. Both ask each peer where it is through the
control plane's ``probe``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from daskdist import config

__all__ = ["StallWatch", "Watched", "describe_timeout", "missing_peers", "report_stall"]

logger = logging.getLogger(__name__)


class Watched(Protocol):
    """What the stall watch and the timeout messages need of a communicator."""

    rank: int
    size: int
    control: Any
    active: tuple[Any, float] | None
    on_stall: Callable[[dict[str, Any]], None] | None

    def report_stall(self, call: Any, waited: float) -> None: ...


def missing_peers(comm: Watched, call: Any) -> list[tuple[int, str]]:
    """Probe the peers: ``(rank, where it is)`` for each that has not joined ``call``."""
    probe_timeout = config.get_seconds("collective.status-probe-timeout")
    missing = []
    for rank in range(comm.size):
        if rank != comm.rank:
            where = _where(comm.control.probe(rank, probe_timeout), call)
            if where is not None:
                missing.append((rank, where))
    return missing


def describe_timeout(comm: Watched, call: Any, waiting_for: int) -> str:
    """Explain a timeout: which replicas never joined this collective, and where they are."""
    missing = [f"replica {rank} {where}" for rank, where in missing_peers(comm, call)]
    head = f"{call.kind} #{call.seq} of run {call.run_id} timed out after {call.timeout:g}s on replica {comm.rank}"
    if missing:
        return f"{head}: " + "; ".join(missing)
    return f"{head}: every replica joined, but data from replica {waiting_for} did not arrive in time"


def report_stall(comm: Watched, call: Any, waited: float) -> None:
    """Warn that ``comm`` has waited ``waited`` seconds in ``call`` (and tell its ``on_stall``)."""
    missing = missing_peers(comm, call)
    active = comm.active
    if active is None or active[0] is not call:
        return  # it completed while the peers were probed: not a stall
    head = f"{call.kind} #{call.seq} of run {call.run_id}: replica {comm.rank} has waited {waited:.1f}s for its peers"
    if missing:
        message = f"{head}; not joined: " + "; ".join(f"replica {r} {where}" for r, where in missing)
    else:
        message = f"{head}; every replica joined, the data is slow to arrive"
    logger.warning("%s", message)
    if comm.on_stall is not None:
        comm.on_stall({"run_id": call.run_id, "collective": call.seq, "kind": call.kind, "replica": comm.rank,
                       "waited": waited, "missing": [r for r, _ in missing], "message": message})


class StallWatch:
    """A daemon thread that reports a communicator's collective once it has run longer than ``threshold``.

    The collective path only sets ``Communicator.active``; this thread polls it
    (a few times per threshold, at most once a second) and reports each stalled
    collective once.
    """

    def __init__(self, comm: Watched, threshold: float):
        self._comm = weakref.ref(comm)  # a communicator dropped without ``close`` still ends the thread
        self.threshold = threshold
        self.interval = max(0.05, min(1.0, threshold / 4))
        self._stop = threading.Event()
        self._reported: tuple[int, int] | None = None
        self._settings = config.current_snapshot()  # the replica's settings (the client's), read by this thread too
        self._thread = threading.Thread(target=self._watch, name=f"daskdist-stall-watch-{comm.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        with config.use_snapshot(self._settings):
            self._run()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            comm = self._comm()
            if comm is None:
                return
            active = comm.active
            if active is None:
                del comm
                continue
            call, since = active
            waited = time.monotonic() - since
            if waited >= self.threshold and self._reported != (call.run_id, call.seq):
                self._reported = (call.run_id, call.seq)
                try:
                    comm.report_stall(call, waited)
                except Exception as e:  # a warning must never break the replica
                    logger.debug("Stall report failed: %s", e)
            del comm, call, active


def _where(status: dict[str, Any] | None, call: Any) -> str | None:
    """Describe a peer that has not joined ``call``, or ``None`` if it has."""
    if status is None:
        return "did not answer a status request (its worker may be busy or gone)"
    run, seq = status.get("run_id", -1), status.get("collective", 0)
    state = status.get("state")
    if run < call.run_id:
        return f"never started run {call.run_id} (it is {state}, last run {run})"
    if run > call.run_id:
        return None
    if seq >= call.seq:
        return None
    if state == "idle":
        return f"finished run {call.run_id} after joining {seq} collective(s), without joining this one"
    return f"has not joined it (it is at collective #{seq} of run {run}, or in user code)"
