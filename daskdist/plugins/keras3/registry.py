"""Which Keras objects were created inside a strategy's scope, and what the replicas hold of them.

Models and optimizers created in ``strategy.scope()`` on the client, and
metrics created in a ``ParameterServerStrategy``'s scope (``ps_metrics``), are
recorded here (a weak mapping: the record goes with the object); TensorFlow
keeps the same link as ``model._distribution_strategy``.
"""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from daskdist import context
from daskdist.strategy.base import Strategy

__all__ = ["Record", "current_client_strategy", "is_open", "items", "lookup", "register"]


@dataclass
class Record:
    """A Keras object's strategy and its copy on the replicas.

    Attributes
    ----------
    strategy
        The strategy whose scope created the object.
    object_id
        Its id in the replicas' resident store.
    fingerprint
        What the replicas hold (architecture, compile settings, weights); ``None`` before the first install.
    driver
        Under ParameterServerStrategy, the step driver of the newest ``fit`` (its parameters on the ps), else ``None``.
    """

    strategy: Any
    object_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    fingerprint: Any = None
    dirty: bool = False
    """The replicas' copy may have changed since the client took its state (a custom loop ran)."""
    driver: Any = None
    optimizer: Any = None
    """Under ParameterServerStrategy, a model's: the optimizer its custom loops apply with (its rule on the ps)."""
    model_id: str | None = None
    """Under ParameterServerStrategy, an optimizer's: the model it was paired with for custom loops."""
    install_error: tuple[Any, BaseException] | None = None
    """A model's failed install before a ``strategy.run``: (the model's fingerprint then, the error)."""


_records: weakref.WeakKeyDictionary[Any, Record] = weakref.WeakKeyDictionary()


def current_client_strategy() -> Any:
    """The strategy whose ``scope()`` this client thread is in, or ``None`` (never inside a replica)."""
    frame = context.current_frame()
    if frame is None or frame.replica_context is not None or frame.owner is not None:
        return None
    strategy = frame.strategy
    return strategy if isinstance(strategy, Strategy) else None


def register(obj: Any, strategy: Any) -> Record:
    """Record that ``obj`` belongs to ``strategy`` (the first scope to claim it keeps it)."""
    record = _records.get(obj)
    if record is None:
        record = _records[obj] = Record(strategy)
    return record


def lookup(obj: Any) -> Record | None:
    """The record of ``obj``, or ``None`` for an object created outside any strategy's scope."""
    try:
        return _records.get(obj)
    except TypeError:  # not weak-referenceable: never registered
        return None


def is_open(record: Record) -> bool:
    """Whether the record's strategy is still open."""
    try:
        record.strategy.extended.check_open()
    except Exception:
        return False
    return True


def items() -> list[tuple[Any, Record]]:
    """Every recorded object with its record (a copy: safe while records come and go)."""
    return list(_records.items())
