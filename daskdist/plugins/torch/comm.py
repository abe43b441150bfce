"""The torch backend's view of daskdist's process group: the one module that knows it.

``ReplicaComm`` runs a collective of the replica's process group
(``daskdist.collective.process_group.ProcessGroup``, this generation's, or a
subgroup of it) for one torch call and completes a ``torch.futures.Future``
with what ``finish`` makes of the result (the copy back into the torch
tensors). Two modes (``daskdist.torch.comm-thread``):

* thread: the collective goes to the group with ``async_op=True`` and runs
  on the generation's FIFO thread, so DDP's bucket all-reduces overlap the
  rest of backward; the torch future completes from that thread;
* inline: the collective runs in the calling thread (no hand-off), the
  torch future is complete when the call returns.

Async work keeps issue order on every replica (the group's one FIFO thread),
and a synchronous call waits for it first, so every replica issues the same
collectives in the same order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Outcome", "ReplicaComm", "comm_thread_wanted"]

logger = logging.getLogger(__name__)

Call = Callable[[Any, bool], Any]  # (process group, async_op) -> result, or a Work when async_op
Finish = Callable[[Any], Any]  # the collective's result -> the torch future's value


def comm_thread_wanted(setting: Any) -> bool:
    """``daskdist.torch.comm-thread``: ``True``/``False``, or ``auto`` (the thread when this thread may use
    more than one core: on one pinned core the thread only competes with backward)."""
    if isinstance(setting, str) and setting.lower() == "auto":
        try:
            return len(os.sched_getaffinity(0)) > 1
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            return True
    if isinstance(setting, str):
        return setting.lower() in ("true", "yes", "1", "thread")
    return bool(setting)


class ReplicaComm:
    """One replica's process group (or a subgroup of it), as the torch backend calls it.

    Parameters
    ----------
    runtime
        The replica's runtime: its ``process_group`` is the generation's root group.
    threaded
        Run collectives on the group's FIFO thread (``True``) or in the caller (``False``).
    group
        A subgroup (``ProcessGroup.new_group``); ``None``: the generation's root group.
    """

    def __init__(self, runtime: Any, threaded: bool, group: Any = None):
        self.runtime = runtime
        self.generation = runtime.generation
        self.threaded = threaded
        self._group = group
        self._closed = False

    @property
    def group(self) -> Any:
        """The daskdist process group, checked to be of the replica's current generation."""
        runtime = self.runtime
        if self._closed:
            raise RuntimeError("the daskdist torch process group was destroyed")
        if runtime.generation != self.generation:
            raise RuntimeError(
                f"this daskdist process group belongs to generation {self.generation} of {runtime.group_id}, "
                f"which moved to generation {runtime.generation}: call dd.plugins.torch.init_process_group() again")
        if runtime.state == "closed":
            raise RuntimeError(f"replica {runtime.rank} of {runtime.group_id} is closed")
        return self._group if self._group is not None else runtime.process_group

    @property
    def all_reduce_now(self) -> Callable[..., Any]:
        """The group's synchronous all-reduce in this thread (``ProcessGroup.inline_all_reduce``), checked as ``group``."""
        return self.group.inline_all_reduce

    def subgroup(self, ranks: list[int], name: str | None) -> ReplicaComm | None:
        """``new_group(ranks)`` of the root group (every replica calls it); ``None`` on non-members."""
        sub = self.group.new_group(ranks, name=name)
        return None if sub is None else ReplicaComm(self.runtime, self.threaded, sub)

    def run(self, call: Call, finish: Finish) -> Outcome:
        """Run ``call`` on the group (async on its thread, or inline); the torch future of ``finish(result)``.

        A failure completes the future with an error as torch's C++ callers
        (DDP's reducer) see one (``Outcome``), never with the exception as
        its value: ``set_exception`` stores a Python object that the reducer
        reads as the collective's result, without the GIL (a segfault).
        """
        try:
            group = self.group
            if self.threaded:
                source: torch.futures.Future = torch.futures.Future()
                outcome = Outcome(source.then(_unwrap))
                work = call(group, True)
                work.get_future().add_done_callback(
                    lambda done: _complete(source, outcome, lambda: finish(done.result())))
                return outcome
            result = finish(call(group, False))
        except BaseException as e:  # noqa: BLE001 - the torch call waiting on the future raises it
            logger.debug("daskdist torch collective failed: %s", e)
            return Outcome.failed(e)
        return Outcome.done(result)

    def call(self, call: Call) -> Any:
        """Run ``call`` on the group now, in this thread (after the async work issued before it)."""
        return call(self.group, False)

    def close(self) -> None:
        """Refuse further collectives (the group's own thread belongs to the generation and stays)."""
        self._closed = True


class Outcome:
    """The torch future of one collective, and its error as Python raises it (``None`` while none).

    ``future`` fails with a C++ error (raised in a ``then`` callback) whose
    message carries the collective's error; ``error`` keeps the exception
    itself, for ``Work.wait`` in Python to raise as it was. A collective that
    ran inline and succeeded has no future until one is asked for
    (``torch_future``): a ``dist.all_reduce(async_op=True)`` followed by
    ``wait()`` makes none.
    """

    __slots__ = ("error", "future", "value")

    def __init__(self, future: Any):
        self.future = future
        self.error: BaseException | None = None
        self.value: Any = None

    @classmethod
    def done(cls, value: Any) -> Outcome:
        """An outcome that succeeded already, with ``value`` (its future is made when asked for)."""
        outcome = cls(None)
        outcome.value = value
        return outcome

    def torch_future(self) -> Any:
        """The torch future (made now, completed, for an outcome that succeeded inline)."""
        if self.future is None:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(self.value)
            self.future = future
        return self.future

    @classmethod
    def failed(cls, error: BaseException) -> Outcome:
        """An outcome already failed with ``error``."""
        source: torch.futures.Future = torch.futures.Future()
        outcome = cls(source.then(_unwrap))
        outcome.error = error
        source.set_result((False, error))
        return outcome


def _unwrap(done: Any) -> Any:
    """``then`` callback: the collective's value, or its error raised (torch marks the future failed)."""
    ok, value = done.value()
    if not ok:
        raise value
    return value


def _complete(source: torch.futures.Future, outcome: Outcome, body: Callable[[], Any]) -> None:
    try:
        result = body()
    except BaseException as e:  # noqa: BLE001 - the torch call waiting on it raises this
        logger.debug("daskdist torch collective failed: %s", e)
        outcome.error = e
        source.set_result((False, e))
        return
    source.set_result((True, result))
