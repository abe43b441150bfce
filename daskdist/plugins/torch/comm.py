"""The torch backend's view of the replica's collectives: one adapter module, the only one that knows them.

``ReplicaComm`` runs daskdist collectives on numpy views of torch tensors,
either inline (in the calling thread) or on one communication thread per
process group (so DDP's bucket all-reduces overlap the rest of backward).
Every operation is queued in call order, so every replica issues the same
collectives in the same order, whatever thread asked. Work completes a
``torch.futures.Future``; a failed collective sets its exception.

This is the seam to the process-group layer (``daskdist.collective``): today
the adapter calls the replica's communicator of its generation
(``ReplicaContext``'s collectives); a group of its own numbering replaces it
without touching the torch side.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from daskdist import config
from daskdist.ops import ReduceOp

__all__ = ["ReplicaComm", "comm_thread_wanted"]

logger = logging.getLogger(__name__)


def comm_thread_wanted(setting: Any) -> bool:
    """``daskdist.torch.comm-thread``: ``True``/``False``, or ``auto`` (a thread when this thread may use
    more than one core: on a pinned core the thread only competes with backward)."""
    if isinstance(setting, str) and setting.lower() == "auto":
        try:
            return len(os.sched_getaffinity(0)) > 1
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            return True
    if isinstance(setting, str):
        return setting.lower() in ("true", "yes", "1", "thread")
    return bool(setting)


class ReplicaComm:
    """Collectives of one replica, in call order, inline or on a communication thread.

    Parameters
    ----------
    runtime
        The replica's runtime (its ``communicator`` is the generation's collectives).
    threaded
        Run collectives on a communication thread (``True``) or in the caller (``False``).
    """

    def __init__(self, runtime: Any, threaded: bool):
        self.runtime = runtime
        self.generation = runtime.generation
        self.threaded = threaded
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], torch.futures.Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._p2p_sent: dict[tuple[int, Any], int] = {}
        self._p2p_received: dict[tuple[int, Any], int] = {}
        self._p2p_run = -1
        if threaded:
            self._thread = threading.Thread(target=self._serve, name=f"daskdist-torch-comm-{runtime.rank}",
                                            daemon=True)
            self._thread.start()

    # -- the queue ------------------------------------------------------------

    def submit(self, body: Callable[[], Any]) -> torch.futures.Future:
        """Run ``body`` (a collective) after the ones already submitted; its future back."""
        future: torch.futures.Future = torch.futures.Future()
        if self._closed:
            future.set_exception(RuntimeError("the daskdist process group was destroyed"))
            return future
        if self._thread is None:
            _complete(future, body)
        else:
            self._queue.put((body, future))
        return future

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            body, future = item
            _complete(future, body)

    def close(self) -> None:
        """Stop the communication thread after the collectives already queued."""
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    # -- collectives over numpy views -------------------------------------------

    @property
    def communicator(self) -> Any:
        runtime = self.runtime
        if runtime.generation != self.generation:
            raise RuntimeError(
                f"this daskdist process group belongs to generation {self.generation} of {runtime.group_id}, "
                f"which moved to generation {runtime.generation}: call dd.plugins.torch.init_process_group() again")
        if runtime.state == "closed":
            raise RuntimeError(f"replica {runtime.rank} of {runtime.group_id} is closed")
        return runtime.communicator

    def all_reduce(self, op: ReduceOp, arrays: list[np.ndarray]) -> list[np.ndarray]:
        result = self.communicator.all_reduce(op, arrays[0] if len(arrays) == 1 else list(arrays))
        return [result] if len(arrays) == 1 else list(result)

    def broadcast(self, arrays: list[np.ndarray], root: int) -> list[np.ndarray]:
        return list(self.communicator.broadcast(list(arrays), root))

    def all_gather(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Concatenate along axis 0, rank order."""
        return list(self.communicator.all_gather(list(arrays), 0))

    def reduce_scatter(self, op: ReduceOp, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Reduce, then this rank's part along axis 0 (``array_split`` order)."""
        return list(self.communicator.reduce_scatter(op, list(arrays), 0))

    def all_gather_objects(self, obj: Any) -> list[Any]:
        return list(self.communicator.all_gather_objects(obj))

    def barrier(self) -> None:
        self.communicator.barrier()

    def _count(self, counters: dict[tuple[int, Any], int], run_id: int, peer: int, tag: Any) -> int:
        """The number of this message between us and ``peer`` under ``tag`` in this run (0, 1, ...)."""
        if self._p2p_run != run_id:  # a new command: numbering starts again on both sides
            self._p2p_run = run_id
            self._p2p_sent.clear()
            self._p2p_received.clear()
        n = counters.get((peer, tag), 0)
        counters[(peer, tag)] = n + 1
        return n

    def send(self, array: np.ndarray, dst: int, tag: Any) -> None:
        """Send ``array`` to rank ``dst`` (matched by ``recv`` of the same tag, in order)."""
        communicator = self.communicator
        n = self._count(self._p2p_sent, communicator.run_id, dst, tag)
        handle = communicator.transport.send(dst, (communicator.run_id, n, communicator.rank, _tag_name(tag)),
                                             np.ascontiguousarray(array))
        handle.wait(time.monotonic() + communicator.default_timeout)

    def recv(self, out: np.ndarray, src: int, tag: Any) -> None:
        """Receive what rank ``src`` sent under ``tag`` into ``out``."""
        communicator = self.communicator
        n = self._count(self._p2p_received, communicator.run_id, src, tag)
        payload = communicator.transport.recv(src, (communicator.run_id, n, src, _tag_name(tag)),
                                              time.monotonic() + communicator.default_timeout)
        incoming = np.asarray(payload)
        if incoming.nbytes != out.nbytes:
            raise ValueError(f"recv from rank {src} (tag {tag}): got {incoming.dtype}{list(incoming.shape)}, "
                             f"expected {out.dtype}{list(out.shape)}")
        np.copyto(out.reshape(-1), incoming.reshape(-1).view(out.dtype))

    def send_object(self, obj: Any, dst: int, tag: Any) -> None:
        """Send any picklable object (arrays inside travel pickled) to rank ``dst``."""
        self.send(np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8), dst, tag)

    def recv_object(self, src: int, tag: Any) -> Any:
        """Receive what ``send_object`` sent from rank ``src`` under ``tag``."""
        communicator = self.communicator
        n = self._count(self._p2p_received, communicator.run_id, src, tag)
        payload = communicator.transport.recv(src, (communicator.run_id, n, src, _tag_name(tag)),
                                              time.monotonic() + communicator.default_timeout)
        return pickle.loads(np.asarray(payload).tobytes())


def _tag_name(tag: Any) -> str:
    """The transports' tag name (at most 40 bytes) of a torch tag (an int) or a subgroup's (a string)."""
    return f"torch:{tag}"[:40]


def _complete(future: torch.futures.Future, body: Callable[[], Any]) -> None:
    try:
        result = body()
    except BaseException as e:  # the torch call waiting on it raises this
        logger.debug("daskdist torch collective failed: %s", e)
        future.set_exception(e)
        return
    future.set_result(result)
