"""``Work``: the handle of a collective started with ``async_op=True`` (as ``torch.distributed.Work``).

A ``Work`` wraps a ``concurrent.futures.Future`` that the group completes
(its FIFO thread, or the caller for a collective that ran inline). ``wait``
returns the collective's result (or raises its error), ``exception`` gives
the error of a failed collective without raising it, ``get_future`` hands
the future itself to code that chains callbacks, ``then`` makes the work of
what a function makes of the result (a torch backend copies results back
into its tensors so), and ``abort`` fails it on every member of the group
(the group's ``abort``). ``Work.completed`` and ``Work.failed`` make works
that are over already (a collective that ran inline); ``DONE`` is the one
completed work of every synchronous call whose result nobody reads.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

__all__ = ["DONE", "Work"]


class Work:
    """A collective in flight on a ``ProcessGroup`` (or over already).

    Parameters
    ----------
    future
        Completed by the group with the collective's result or exception.
    kind
        The collective (``"all_reduce"``, ``"send"``, ...), named in ``repr`` and errors.
    abort
        Called with an exception by ``abort``: aborts the group's collectives
        in flight and queued on every member (``None``: the work cannot be aborted).
    """

    __slots__ = ("_abort", "_future", "_value", "kind")

    def __init__(self, future: concurrent.futures.Future[Any] | None, kind: str,
                 abort: Callable[[BaseException], None] | None = None):
        self._future = future  # None: completed with ``_value`` (its future is made when asked for)
        self._value: Any = None
        self.kind = kind
        self._abort = abort

    @classmethod
    def completed(cls, result: Any, kind: str) -> Work:
        """A ``Work`` that is already done with ``result`` (no future made unless asked for: a collective
        that ran inline costs no lock and no condition)."""
        work = cls(None, kind)
        work._value = result
        return work

    @classmethod
    def failed(cls, error: BaseException, kind: str) -> Work:
        """A ``Work`` that already failed with ``error``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_exception(error)
        return cls(future, kind)

    def then(self, fn: Callable[[Any], Any]) -> Work:
        """The work of ``fn(result)``: done when this one is and ``fn`` ran (in the thread that completed it).

        It fails with this work's error, or with what ``fn`` raised.
        """
        if self._future is None:
            try:
                return Work.completed(fn(self._value), self.kind)
            except BaseException as e:  # noqa: BLE001 - the waiter raises it
                return Work.failed(e, self.kind)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def chain(done: concurrent.futures.Future[Any]) -> None:
            try:
                error = done.exception()
                if error is None:
                    future.set_result(fn(done.result()))
                    return
            except BaseException as e:  # noqa: BLE001 - the waiter raises it
                error = e
            future.set_exception(error)

        self._future.add_done_callback(chain)
        return Work(future, self.kind, self._abort)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finished (at most ``timeout`` seconds); return its result.

        Raises
        ------
        TimeoutError
            ``timeout`` passed first; the collective goes on (its own
            deadline, the group's timeout, still holds).
        Exception
            The collective's own error (``CollectiveMismatchError``,
            ``ReplicaLostError``, ...), on every replica.
        """
        if self._future is None:
            return self._value
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():  # the collective's own error: a CollectiveTimeoutError is a TimeoutError too
                raise
            raise TimeoutError(f"{self.kind} did not complete within {timeout:g}s") from None

    def result(self) -> Any:
        """The collective's result, once finished (waits for it)."""
        return self._value if self._future is None else self._future.result()

    def is_completed(self) -> bool:
        """Whether the collective finished (successfully or not)."""
        return self._future is None or self._future.done()

    def is_success(self) -> bool:
        """Whether the collective finished without an error."""
        future = self._future
        return future is None or (future.done() and not future.cancelled() and future.exception() is None)

    def exception(self) -> BaseException | None:
        """The error of a finished, failed collective; ``None`` if it succeeded or is still running."""
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()

    def get_future(self) -> concurrent.futures.Future[Any]:
        """The future the group completes (add callbacks to it; do not set it)."""
        if self._future is None:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_result(self._value)
            self._future = future
        return self._future

    def abort(self, error: BaseException | None = None) -> None:
        """Abort this collective and the group's others in flight or queued, on every member: they raise.

        Nothing happens to a work that is over already.
        """
        if self.is_completed() or self._abort is None:
            return
        self._abort(error or RuntimeError(f"{self.kind} was aborted"))

    def __repr__(self) -> str:
        state = "running" if not self.is_completed() else ("failed" if self.exception() else "done")
        return f"<Work {self.kind} {state}>"


#: The completed work of every synchronous call whose result nobody reads (no work made per call).
DONE = Work.completed(None, "done")
