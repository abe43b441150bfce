"""A key-value store on the scheduler, scoped per replica group: what ``torch.distributed.Store`` needs.

Frameworks that rendezvous through a store (torch's process groups, NCCL's
unique id) meet here instead of at a ``MASTER_ADDR`` and a port. Keys live
under a scope (the group id and its generation); a scope is dropped when its
group closes. ``wait`` and ``get`` wait on the scheduler's event loop for at
most the ``timeout`` they are given (the caller polls again), so a handler
never holds a comm longer than that.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["KeyValueStore"]


class KeyValueStore:
    """Scoped keys (bytes values); the scheduler plugin serves it as the ``daskdist_kv`` handler."""

    def __init__(self) -> None:
        self._scopes: dict[str, dict[str, bytes]] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def drop(self, prefix: str) -> None:
        """Forget every scope that starts with ``prefix`` (its group closed), waking its waiters."""
        for scope in [s for s in self._scopes if s.startswith(prefix)]:
            del self._scopes[scope]
            event = self._changed.pop(scope, None)
            if event is not None:
                event.set()

    def _touch(self, scope: str) -> None:
        event = self._changed.pop(scope, None)
        if event is not None:
            event.set()

    async def _wait_for(self, scope: str, keys: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            data = self._scopes.get(scope, {})
            if all(k in data for k in keys):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            event = self._changed.setdefault(scope, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return False

    async def handle(self, scope: str, action: str, keys: list[str] | None = None, value: Any = None,
                     expected: Any = None, timeout: float = 0.0) -> dict[str, Any]:
        """Run one store operation; never raises across the wire (an error message instead).

        ``action``: ``set``, ``get`` (waits up to ``timeout``), ``add`` (an int,
        returns the new value), ``compare_set``, ``check``, ``wait``,
        ``delete``, ``num_keys``. Values are bytes.
        """
        keys = list(keys or [])
        data = self._scopes.setdefault(scope, {})
        if action == "set":
            data[keys[0]] = bytes(value)
            self._touch(scope)
            return {"status": "OK"}
        if action in ("get", "wait"):
            if not await self._wait_for(scope, keys, timeout):
                return {"status": "waiting"}
            data = self._scopes.get(scope, {})
            return {"status": "OK", "value": data[keys[0]] if action == "get" else None}
        if action == "add":
            new = int(data.get(keys[0], b"0")) + int(value)
            data[keys[0]] = str(new).encode()
            self._touch(scope)
            return {"status": "OK", "value": new}
        if action == "compare_set":
            current = data.get(keys[0])
            if (current is None and not expected) or current == bytes(expected or b""):
                data[keys[0]] = bytes(value)
                self._touch(scope)
                return {"status": "OK", "value": bytes(value)}
            return {"status": "OK", "value": current if current is not None else bytes(expected or b"")}
        if action == "check":
            return {"status": "OK", "value": all(k in data for k in keys)}
        if action == "delete":
            return {"status": "OK", "value": data.pop(keys[0], None) is not None}
        if action == "num_keys":
            return {"status": "OK", "value": len(data)}
        return {"status": "error", "message": f"unknown store operation {action!r}"}
