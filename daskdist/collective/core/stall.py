"""Where the peers are when a collective waits: skipped collectives, stall warnings, timeout messages.

A replica waiting in one collective asks its peers where they are (the
control plane's ``probe``), in a watch thread (``StallWatch``) that only
looks at collectives that already wait:

* after ``daskdist.collective.skip-check`` (1 s) and then every as long: a
  peer that has finished the client command without joining this
  collective (it is idle, or in a later command, with fewer collectives of
  the attempt) will never join it. The collective is aborted on every replica
  at once with a ``CollectiveMismatchError`` naming that replica and the
  collective it skipped (``check_skipped``). A peer still running the
  command (slow, in user code) is never judged: the collective waits its
  full timeout for it. A collective whose timeout is at most twice
  ``skip-check`` is not checked: it times out first, with the same names
  in its ``CollectiveTimeoutError``.
* after ``daskdist.collective.stall-warning`` (10 s): a warning naming the
  replicas that have not joined (``report_stall``);
* at the timeout: ``CollectiveTimeoutError`` says the same (``describe_timeout``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from daskdist import config
from daskdist.collective.mailbox import Abort

__all__ = ["StallWatch", "Watched", "check_skipped", "describe_timeout", "missing_peers", "report_stall"]

logger = logging.getLogger(__name__)


class Watched(Protocol):
    """What the stall watch and the timeout messages need of a communicator."""

    rank: int
    size: int
    control: Any
    active: tuple[Any, float] | None
    on_stall: Callable[[dict[str, Any]], None] | None

    def report_stall(self, call: Any, waited: float) -> None: ...

    def check_skipped(self, call: Any) -> bool: ...

    def abort_with(self, abort: Abort) -> None: ...


def missing_peers(comm: Watched, call: Any) -> list[tuple[int, str]]:
    """Probe the peers: ``(rank, where it is)`` for each that has not joined ``call``."""
    return [(rank, where) for rank, where, _ in _probe_peers(comm, call)]


def _probe_peers(comm: Watched, call: Any) -> list[tuple[int, str, bool]]:
    """``(rank, where it is, whether it skipped call)`` for each peer that has not joined ``call``."""
    probe_timeout = config.get_seconds("collective.status-probe-timeout")
    missing = []
    for rank in range(comm.size):
        if rank != comm.rank:
            status = comm.control.probe(rank, probe_timeout)
            where = _where(status, call)
            if where is not None:
                missing.append((rank, where, _skipped(status, call)))
    return missing


def check_skipped(comm: Watched, call: Any) -> bool:
    """Abort ``call`` on every replica if a peer finished the command without joining it; whether one did.

    The error (``CollectiveMismatchError``, kind ``mismatch``) names each
    such replica and the collective it skipped.
    """
    skipped = [(rank, where) for rank, where, skip in _probe_peers(comm, call) if skip]
    active = comm.active
    if not skipped or active is None or active[0] is not call:
        return False  # it completed while the peers were probed
    names = "; ".join(f"replica {rank} {where}" for rank, where in skipped)
    message = (f"{call.kind} #{call.seq} (run {call.run_id}) cannot complete: {names}. Every replica must call "
               "the same collectives in the same order")
    logger.warning("%s", message)
    comm.abort_with(Abort("mismatch", message, comm.rank))
    return True


def describe_timeout(comm: Watched, call: Any, waiting_for: int) -> str:
    """Explain a timeout: which replicas never joined this collective, and where they are."""
    missing = [f"replica {rank} {where}" for rank, where in missing_peers(comm, call)]
    head = f"{call.kind} #{call.seq} (run {call.run_id}) timed out after {call.timeout:g}s on replica {comm.rank}"
    if missing:
        return f"{head}: " + "; ".join(missing)
    return f"{head}: every replica joined, but data from replica {waiting_for} did not arrive in time"


def report_stall(comm: Watched, call: Any, waited: float) -> None:
    """Warn that ``comm`` has waited ``waited`` seconds in ``call`` (and tell its ``on_stall``)."""
    missing = missing_peers(comm, call)
    active = comm.active
    if active is None or active[0] is not call:
        return  # it completed while the peers were probed: not a stall
    head = f"{call.kind} #{call.seq} (run {call.run_id}): replica {comm.rank} has waited {waited:.1f}s for its peers"
    if missing:
        message = f"{head}; not joined: " + "; ".join(f"replica {r} {where}" for r, where in missing)
    else:
        message = f"{head}; every replica joined, the data is slow to arrive"
    logger.warning("%s", message)
    if comm.on_stall is not None:
        comm.on_stall({"run_id": call.run_id, "collective": call.seq, "kind": call.kind, "replica": comm.rank,
                       "waited": waited, "missing": [r for r, _ in missing], "message": message})


class StallWatch:
    """A daemon thread that watches a communicator's collective once it waits.

    It checks for peers that skipped it every ``skip_check`` seconds of
    waiting (``0``: never) and reports it once it has waited ``threshold``
    seconds (``0``: never). The collective path only sets
    ``Communicator.active``; this thread polls it.
    """

    def __init__(self, comm: Watched, threshold: float, skip_check: float = 0.0):
        self._comm = weakref.ref(comm)  # a communicator dropped without ``close`` still ends the thread
        self.threshold = threshold
        self.skip_check = skip_check
        periods = [p for p in (threshold, skip_check) if p > 0] or [1.0]
        self.interval = max(0.05, min(1.0, min(periods) / 4))
        self._stop = threading.Event()
        self._reported: tuple[int, int, int] | None = None
        self._checked: tuple[tuple[int, int, int], float] | None = None  # the call last checked, and when
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
            now = time.monotonic()
            waited = now - since
            identity = (call.attempt, call.seq, call.run_id)
            try:
                if self.skip_check > 0 and waited >= self.skip_check and call.timeout > 2 * self.skip_check and (
                        self._checked is None or self._checked[0] != identity
                        or now - self._checked[1] >= self.skip_check):
                    self._checked = (identity, now)
                    if comm.check_skipped(call):
                        continue
                if self.threshold > 0 and waited >= self.threshold and self._reported != identity:
                    self._reported = identity
                    comm.report_stall(call, waited)
            except Exception as e:  # a warning must never break the replica
                logger.debug("Stall watch failed: %s", e)
            finally:
                del comm, call, active


def _skipped(status: dict[str, Any] | None, call: Any) -> bool:
    """Whether the peer described by ``status`` finished ``call``'s command without joining it (never will).

    ``status`` is read state first (``ReplicaRuntime.status``): a peer seen
    idle has no collective of that command left to join.
    """
    if status is None or status.get("attempt", call.attempt) != call.attempt:
        return False
    run, seq = status.get("run_id", -1), status.get("collective", 0)
    if seq >= call.seq or run < call.run_id:
        return False
    return run > call.run_id or status.get("state") == "idle"


def _where(status: dict[str, Any] | None, call: Any) -> str | None:
    """Describe a peer that has not joined ``call``, or ``None`` if it has."""
    if status is None:
        return "did not answer a status request (its worker may be busy or gone)"
    run, seq = status.get("run_id", -1), status.get("collective", 0)
    state = status.get("state")
    if status.get("attempt", call.attempt) != call.attempt:
        return None  # a command failed meanwhile: this collective is being aborted
    if run < call.run_id:
        return f"never started run {call.run_id} (it is {state}, last run {run})"
    if seq >= call.seq:
        return None
    if run > call.run_id:
        return (f"finished run {call.run_id} after joining {seq} collective(s) of the group, without joining "
                f"this one (it is in run {run})")
    if state == "idle":
        return f"finished run {call.run_id} after joining {seq} collective(s) of the group, without joining this one"
    return f"has not joined it (it is at collective #{seq} of the group in run {run}, or in user code)"
