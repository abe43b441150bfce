"""Collectives among a group's replicas: the public face is ``ProcessGroup`` and ``Work``.

The face
    ``process_group.ProcessGroup`` (sync and async collectives, point-to-point,
    subgroups, fences and aborts; what ``ReplicaContext.all_reduce`` and the
    torch backend call), ``work.Work`` (a collective in flight) and
    ``subgroup`` (how a subgroup's messages are told apart).
Below it
    ``core`` (the communicator, its calls, mailbox, packing, algorithms),
    ``engines`` (the all-reduce engines and the chooser's plans; ``nccl`` and
    ``single_copy`` are packages of their own) and ``transport`` (shared
    memory, sockets, UCX, Dask comms).

The names are loaded when first asked for, so importing the package (as the
client does for the settings) does not load the communicator and transports.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ProcessGroup", "Work"]

_FACE = {"ProcessGroup": "daskdist.collective.process_group", "Work": "daskdist.collective.work"}


def __getattr__(name: str) -> Any:
    """Load ``ProcessGroup`` or ``Work`` from its module when first asked for."""
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
