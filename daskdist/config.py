"""daskdist's settings in ``dask.config`` (``daskdist.*`` keys, ``DASK_DASKDIST__...`` env vars).

One policy decides where a key is read: **in the client process.** When a
strategy starts its replica group, the client takes a snapshot of every
``daskdist.*`` key (``snapshot()``) and the group's spec carries it to the
replicas; a replica thread reads only that snapshot (``use_snapshot``), so
``get`` on a replica returns the client's value, and a key set only in a
worker's environment or config files does not change the replicas. When the
client's ``daskdist.*`` settings differ from what the replicas hold (a
``dask.config.set`` around ``strategy.run``), the next command carries a new
snapshot (``install_snapshot`` on the replica thread): keys read per run
(collective timeouts, ...) follow the client as it is when the command is
sent; keys read when the group starts (transport, shm, hosts, pin-cores,
malloc) apply to new strategies. Code that is no replica (the client, the
scheduler plugin's dashboard store) reads ``dask.config`` where it runs.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Iterator
from typing import Any

import dask.config
import yaml

__all__ = ["current_snapshot", "get", "get_seconds", "install_snapshot", "live_settings", "snapshot", "use_snapshot"]

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "daskdist.yaml")

with open(_DEFAULTS_FILE) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)

_local = threading.local()


def get(key: str, default: Any = None) -> Any:
    """Read ``daskdist.<key>``: from this thread's snapshot in a replica, else from ``dask.config``."""
    installed = getattr(_local, "snapshot", None)
    if installed is not None:
        return dask.config.get(f"daskdist.{key}", default, config=installed)
    return dask.config.get(f"daskdist.{key}", default)


def get_seconds(key: str) -> float:
    """Read a duration key (``"60s"``, ``"2 minutes"`` or a number) as seconds."""
    from dask.utils import parse_timedelta

    value = get(key)
    seconds = parse_timedelta(value, default="seconds")
    if seconds is None:
        raise ValueError(f"daskdist.{key} must be a duration, got {value!r}")
    return float(seconds)


def snapshot() -> dict[str, Any]:
    """Every ``daskdist.*`` key as this process sees it now, as ``{"daskdist": {...}}`` (a deep copy)."""
    return {"daskdist": copy.deepcopy(dask.config.get("daskdist"))}


def live_settings() -> Any:
    """This process's ``daskdist`` settings as they are now (not a copy: compare, never modify)."""
    return dask.config.get("daskdist")


def install_snapshot(settings: dict[str, Any]) -> None:
    """Make ``get`` in this thread read ``settings`` from now on (a replica thread given a newer snapshot)."""
    _local.snapshot = settings


def current_snapshot() -> dict[str, Any] | None:
    """The snapshot this thread reads (``use_snapshot``), or ``None`` outside replicas."""
    return getattr(_local, "snapshot", None)


@contextlib.contextmanager
def use_snapshot(settings: dict[str, Any] | None) -> Iterator[None]:
    """Make ``get`` in this thread read ``settings`` (from ``snapshot()``) instead of ``dask.config``.

    ``None`` leaves the thread as it is. Threads a replica starts wrap their
    body in ``use_snapshot(current_snapshot())`` taken on the replica thread.
    """
    if settings is None:
        yield
        return
    previous = getattr(_local, "snapshot", None)
    _local.snapshot = settings
    try:
        yield
    finally:
        _local.snapshot = previous
