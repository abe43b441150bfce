"""Live replica groups of this process, by token, so pickled references find their owner.

A ``MirroredVariable`` or strategy captured by a function pickles as a small
reference (group token + id). When it is unpickled on the client (results of
``strategy.run``), the token is looked up here; inside a replica thread the
replica runtime resolves it to the replica's own copy instead.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["lookup", "register", "unregister"]

_owners: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(token: str, owner: Any) -> None:
    """Make ``owner`` (a strategy's extended object) findable by ``token``."""
    _owners[token] = owner


def unregister(token: str) -> None:
    _owners.pop(token, None)


def lookup(token: str) -> Any:
    """The live owner for ``token`` in this process, or ``None``."""
    return _owners.get(token)
