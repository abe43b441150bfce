"""A parameter store's synchronous rounds: every replica contributes, the round is finished once, all get its result.

CentralStorage's gradient steps and replica-context assigns are rounds
(``daskdist.ps.store``'s ``contribute``). A contributor waits for the round's
result in slices (``wait`` seconds, then it asks again), from either side of
the store:

* on the worker's event loop (a request through Dask's comms): ``wait_async``
  awaits a future the finishing thread wakes with ``call_soon_threadsafe``;
* on a thread (a replica of the store's own process, or a thread of the
  direct channel, ``daskdist.ps.channel``): ``Round.wait`` blocks on a
  ``threading.Event``.

Whoever brings the last contribution finishes the round, under the store's
lock, in whichever thread it runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Round", "SynchronousRounds"]


class Round:
    """One synchronous round: contributions by rank until all ``size`` came, then one result for all."""

    def __init__(self, size: int):
        self.size = size
        self.contributions: dict[int, Any] = {}
        self.result: Any = None
        self.error: BaseException | None = None
        self.fetched: set[int] = set()
        self._done = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._guard = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Set the round's result (or error) and wake every waiter, blocking or on an event loop."""
        with self._guard:
            if self._done.is_set():
                return
            self.result, self.error = result, error
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    def wait(self, timeout: float) -> bool:
        """Block this thread until the round is done, at most ``timeout`` seconds; whether it is."""
        return self._done.wait(max(float(timeout), 0.0))

    async def wait_async(self, timeout: float) -> bool:
        """``wait`` on the running event loop (the loop is not blocked)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._guard:
            if self._done.is_set():
                return True
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(future, max(float(timeout), 0.0))
        except asyncio.TimeoutError:
            with self._guard:
                self._waiters = [w for w in self._waiters if w[1] is not future]
        return self._done.is_set()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class SynchronousRounds:
    """The open rounds of one store, keyed ``(store id, key, round id)``; the caller holds the store's lock."""

    def __init__(self) -> None:
        self._rounds: dict[tuple[str, str, int], Round] = {}

    def contribute(self, round_key: tuple[str, str, int], rank: int, size: int, has_payload: bool, payload: Any,
                   finish: Callable[[dict[int, Any]], Any]) -> Round:
        """Add ``rank``'s payload to its round (made if new); the last contribution runs ``finish`` on them all."""
        round_ = self._rounds.get(round_key)
        if round_ is None:
            self._drop_stale(round_key)
            round_ = self._rounds[round_key] = Round(size=int(size))
        if round_.size != size:
            raise ValueError(f"round {round_key[2]} of {round_key[1]!r}: {size} replicas contribute, the round "
                             f"expects {round_.size}")
        if has_payload and rank not in round_.contributions and not round_.done():
            round_.contributions[int(rank)] = payload
            if len(round_.contributions) == round_.size:
                try:
                    round_.finish(result=finish(round_.contributions))
                except Exception as e:  # noqa: BLE001 - every contributor gets the error
                    round_.finish(error=e)
        return round_

    def collect(self, round_key: tuple[str, str, int], round_: Round, rank: int) -> dict[str, Any]:
        """``rank``'s answer from a done round (forgotten once every rank has it); raises the round's error."""
        round_.fetched.add(int(rank))
        if len(round_.fetched) >= round_.size:
            self._rounds.pop(round_key, None)
        if round_.error is not None:
            raise round_.error
        return {"status": "OK", "result": round_.result}

    def drop_store(self, store_id: str, reason: str) -> None:
        """Fail and forget every round of ``store_id`` (its strategy closed)."""
        for round_key in [k for k in self._rounds if k[0] == store_id]:
            self._rounds.pop(round_key).finish(error=RuntimeError(reason))

    def _drop_stale(self, round_key: tuple[str, str, int]) -> None:
        """Forget rounds of the same key left by earlier commands (a replica failed before contributing)."""
        store_id, key, round_id = round_key
        for stale in [k for k in self._rounds if k[:2] == (store_id, key) and k[2] >> 32 < round_id >> 32]:
            self._rounds.pop(stale).finish(error=RuntimeError(
                f"round {stale[2] & 0xFFFFFFFF} of {key!r} was abandoned: a later command started"))
