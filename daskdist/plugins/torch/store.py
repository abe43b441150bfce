"""``DaskdistStore``: a ``torch.distributed.Store`` served by the Dask scheduler (no ``MASTER_ADDR``, no port).

Every call is one request to the daskdist scheduler plugin's ``daskdist_kv``
handler (``daskdist.group.kv_store``) through the worker's scheduler
connection. Keys are scoped per replica group and membership generation, so
a re-formed group never reads a key of its previous generation; the scope is
dropped when the group closes.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch.distributed as dist
from distributed.utils import sync

__all__ = ["DaskdistStore"]

_POLL = 0.5  # seconds one blocking request waits on the scheduler before asking again


class DaskdistStore(dist.Store):  # type: ignore[misc]
    """A ``torch.distributed.Store`` whose keys live on the Dask scheduler.

    Parameters
    ----------
    worker
        The Dask worker of the replica (its scheduler connection carries the requests).
    scope
        The keys' namespace, ``"<group id>/<generation>"``.
    timeout
        How long ``get`` and ``wait`` wait for keys by default.
    """

    def __init__(self, worker: Any, scope: str, timeout: datetime.timedelta = datetime.timedelta(seconds=300)):
        super().__init__()
        self._worker = worker
        self._scope = scope
        self._timeout = timeout

    def _call(self, action: str, keys: list[str] | None = None, **kwargs: Any) -> Any:
        wait = float(kwargs.get("timeout", 0.0))
        response = sync(self._worker.loop, self._worker.scheduler.daskdist_kv, scope=self._scope, action=action,
                        keys=keys or [], callback_timeout=wait + 30, **kwargs)
        if response.get("status") == "error":
            raise RuntimeError(f"daskdist store: {response.get('message')}")
        return response

    def _blocking(self, action: str, keys: list[str], timeout: datetime.timedelta | None = None) -> Any:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            response = self._call(action, keys, timeout=max(0.0, min(_POLL, remaining)))
            if response["status"] == "OK":
                return response.get("value")
            if remaining <= 0:
                raise dist.DistStoreError(
                    f"daskdist store: keys {keys} of {self._scope} did not appear within {limit:g} s")

    def set(self, key: str, value: Any) -> None:
        self._call("set", [key], value=_bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._blocking("get", [key]))

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", [key], value=int(value))["value"])

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return bytes(self._call("compare_set", [key], value=_bytes(desired_value),
                                expected=_bytes(expected_value))["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys))["value"])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._blocking("wait", list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", [key])["value"])

    def num_keys(self) -> int:
        return int(self._call("num_keys")["value"])

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
