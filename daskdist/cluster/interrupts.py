"""A client that stops waiting: the replicas stop with it, and an embedded cluster closes on SIGTERM.

Two things happen when the client process is interrupted in the middle of a
command (``fit``, ``strategy.run``):

- ``abort_interrupted_run``: the client interrupted while it waits for a run
  (Ctrl-C, ``SystemExit``) aborts that run on every replica, so they do not
  go on training for a client that no longer listens (their next collective
  raises ``CollectiveAbortedError`` and they are idle again). The user's
  ``KeyboardInterrupt`` is raised again, never swallowed.
- ``EmbeddedShutdown``: while a strategy owns an embedded cluster, SIGTERM
  in the main thread raises ``SystemExit(143)`` (the status a shell reports
  for a process killed by SIGTERM) instead of ending the process on the
  spot, so ``finally`` clauses run and, at exit, the open embedded strategies
  are closed: replicas stop and remove their shared-memory segments before
  the workers go. Only installed over Python's default SIGTERM action (a
  handler of the user's own is left alone); a second SIGTERM during that
  shutdown ends the process at once.

A client process killed outright (SIGKILL) or disconnected is handled on the
scheduler: ``DaskdistSchedulerPlugin.remove_client`` closes its groups.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from daskdist.collective.mailbox import Abort

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["EmbeddedShutdown", "abort_interrupted_run"]

logger = logging.getLogger(__name__)

ABORT_TIMEOUT = 5.0  # seconds the client waits for the replicas to take an interrupted run's abort


async def _abort_all(client: Client, addresses: list[str], group_id: str, ranks: list[int], run_id: int,
                     abort: dict[str, Any], generation: int) -> None:
    async def one(rank: int) -> None:
        try:
            await asyncio.wait_for(client.rpc(addresses[rank]).daskdist_abort(
                group_id=group_id, rank=rank, run_id=run_id, abort=abort, generation=generation), ABORT_TIMEOUT)
        except Exception as e:  # the worker may be gone: nothing runs there any more
            logger.debug("Could not abort run %d on replica %d of %s: %r", run_id, rank, group_id, e)

    await asyncio.gather(*(one(r) for r in ranks))


def abort_interrupted_run(client: Client, addresses: list[str], group_id: str, ranks: list[int], run_id: int,
                          reason: BaseException, generation: int = 0) -> None:
    """Abort ``run_id`` on ``ranks`` because the client stopped waiting for it (``reason``); never raises.

    A second interruption while the aborts go out propagates (it is the user's).
    """
    message = (f"the client stopped waiting for run {run_id} of {group_id} "
               f"({type(reason).__name__}: the script was interrupted)")
    logger.info("Aborting run %d on the replicas of %s: the client was interrupted (%s)", run_id, group_id,
                type(reason).__name__)
    try:
        client.sync(_abort_all, client, addresses, group_id, ranks, run_id,  # type: ignore[no-untyped-call]
                    Abort("aborted", message, None).to_msg(), generation, callback_timeout=ABORT_TIMEOUT + 1)
    except Exception as e:  # the client's loop or the cluster may be closing
        logger.debug("Could not abort run %d of %s: %r", run_id, group_id, e)


class EmbeddedShutdown:
    """SIGTERM and interpreter exit close the strategies that own an embedded cluster (process-wide).

    ``register(extended)`` when a strategy starts its embedded cluster,
    ``unregister(extended)`` when it closes; the SIGTERM handler is installed
    while at least one is registered (main thread only) and restored after.
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _open: ClassVar[weakref.WeakSet[Any]] = weakref.WeakSet()
    _installed: ClassVar[bool] = False
    _atexit_registered: ClassVar[bool] = False

    @classmethod
    def register(cls, owner: Any) -> None:
        """Close ``owner`` (it has ``close()``) at exit, and turn SIGTERM into ``SystemExit`` meanwhile."""
        with cls._lock:
            cls._open.add(owner)
            if not cls._atexit_registered:
                atexit.register(cls.close_all)
                cls._atexit_registered = True
            if cls._installed or threading.current_thread() is not threading.main_thread():
                return
            try:
                if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                    return  # the user's own handler (or an ignore) decides
                signal.signal(signal.SIGTERM, cls._on_sigterm)
            except (ValueError, OSError) as e:  # pragma: no cover - an interpreter without signals
                logger.debug("Could not install a SIGTERM handler: %s", e)
                return
            cls._installed = True

    @classmethod
    def unregister(cls, owner: Any) -> None:
        """``owner`` closed: forget it; restore the default SIGTERM action when none is left."""
        with cls._lock:
            cls._open.discard(owner)
            if cls._open or not cls._installed:
                return
            if threading.current_thread() is not threading.main_thread():
                return  # the handler stays, and acts as the default once nothing is open (``_on_sigterm``)
            if signal.getsignal(signal.SIGTERM) is cls._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            cls._installed = False

    @classmethod
    def close_all(cls) -> None:
        """Close every registered owner (at exit); errors are logged, never raised."""
        for owner in list(cls._open):
            try:
                owner.close()
            except Exception as e:  # exiting: say it, go on with the others
                logger.warning("Could not close %r at exit: %r", owner, e)

    @staticmethod
    def _on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        if not EmbeddedShutdown._open:
            os.kill(os.getpid(), signal.SIGTERM)  # nothing of ours is open: the default action
            return
        logger.warning("SIGTERM: stopping the replicas and closing the embedded cluster before exiting")
        raise SystemExit(128 + signum)
