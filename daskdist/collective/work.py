"""``Work``: the handle of a collective started with ``async_op=True`` (as ``torch.distributed.Work``).

A ``Work`` wraps the ``concurrent.futures.Future`` the group's FIFO thread
completes. ``wait`` returns the collective's result (or raises its error),
``exception`` gives the error of a failed collective without raising it,
``get_future`` hands the future itself to code that chains callbacks (a
torch backend wraps it into a ``torch.futures.Future``).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

__all__ = ["Work"]


class Work:
    """A collective in flight on a ``ProcessGroup``.

    Parameters
    ----------
    future
        Completed by the group with the collective's result or exception.
    kind
        The collective (``"all_reduce"``, ``"send"``, ...), named in ``repr``.
    """

    __slots__ = ("_future", "kind")

    def __init__(self, future: concurrent.futures.Future[Any], kind: str):
        self._future = future
        self.kind = kind

    @classmethod
    def completed(cls, result: Any, kind: str) -> Work:
        """A ``Work`` that is already done with ``result``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(result)
        return cls(future, kind)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finished (at most ``timeout`` seconds); return its result.

        Raises
        ------
        TimeoutError
            ``timeout`` passed first; the collective goes on (its own
            deadline, ``CommunicationOptions.timeout_seconds``, still holds).
        Exception
            The collective's own error (``CollectiveMismatchError``,
            ``ReplicaLostError``, ...), on every replica.
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self.kind} did not complete within {timeout:g}s") from None

    def result(self) -> Any:
        """The collective's result, once finished (waits for it)."""
        return self._future.result()

    def is_completed(self) -> bool:
        """Whether the collective finished (successfully or not)."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the collective finished without an error."""
        return self._future.done() and not self._future.cancelled() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """The error of a finished, failed collective; ``None`` if it succeeded or is still running."""
        if not self._future.done():
            return None
        return self._future.exception()

    def get_future(self) -> concurrent.futures.Future[Any]:
        """The future the group completes (add callbacks to it; do not set it)."""
        return self._future

    def __repr__(self) -> str:
        state = "running" if not self._future.done() else ("failed" if self._future.exception() else "done")
        return f"<Work {self.kind} {state}>"
