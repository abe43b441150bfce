"""Workers that failed an elastic group: kept out for a cooldown, counted, named in the final error.

Client side, one ``Quarantine`` per replica group (``quarantine_of``). A
worker is known by its Dask name when it has one (a nanny restarts a worker
under the same name, on a new port), else by its address; the names of the
members are remembered while they are alive (``remember``), since a lost
worker is no longer in the scheduler's list.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Quarantine", "quarantine_of"]


class Quarantine:
    """When each worker failed, and whether it may be admitted again.

    Parameters
    ----------
    clock
        Seconds, monotonic (``time.monotonic``; a fake in unit tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.names: dict[str, str] = {}  # address -> Dask worker name
        self.failures: dict[str, list[float]] = {}  # worker identity -> when it failed

    def identity(self, address: str) -> str:
        """The name a worker is known by: its Dask name, else its address."""
        return self.names.get(address, address)

    def remember(self, workers: dict[str, Any]) -> None:
        """Learn the names of ``workers`` (``scheduler_info()["workers"]``: address -> info with ``name``)."""
        for address, info in workers.items():
            name = info.get("name") if isinstance(info, dict) else None
            if name is not None and str(name) != address:
                self.names[address] = str(name)

    def failed(self, addresses: Iterable[str]) -> None:
        """Record that the workers at ``addresses`` were lost now."""
        now = self.clock()
        for address in addresses:
            self.failures.setdefault(self.identity(address), []).append(now)

    def cooling(self, address: str, cooldown: float) -> bool:
        """Whether the worker at ``address`` failed less than ``cooldown`` seconds ago (not to be admitted)."""
        times = self.failures.get(self.identity(address))
        return bool(times) and self.clock() - times[-1] < cooldown  # type: ignore[index]

    def describe(self) -> str:
        """``"w1 (2 times), tcp://... (1 time)"``: every worker that failed, most failures first."""
        ranked = sorted(self.failures.items(), key=lambda item: (-len(item[1]), item[0]))
        return ", ".join(f"{name} ({len(t)} time{'s' if len(t) != 1 else ''})" for name, t in ranked)


_QUARANTINES: weakref.WeakKeyDictionary[Any, Quarantine] = weakref.WeakKeyDictionary()


def quarantine_of(group: Any) -> Quarantine:
    """The quarantine of a replica group (made at first use; it lives as long as the group)."""
    quarantine = _QUARANTINES.get(group)
    if quarantine is None:
        quarantine = _QUARANTINES[group] = Quarantine()
    return quarantine
