"""Live replica groups of this process, by token, so pickled references find their owner.

A ``MirroredVariable`` or strategy captured by a function pickles as a small
reference (group token + id). When it is unpickled on the client (results of
``strategy.run``), the token is looked up here; inside a replica thread the
replica runtime resolves it to the replica's own copy instead
(:func:`resolve_strategy`: both the client's strategy and the replica's view
of it pickle as that one call).
"""

from __future__ import annotations

import weakref
from typing import Any

from daskdist import context
from daskdist.exceptions import StrategyClosedError

__all__ = ["lookup", "register", "resolve_strategy", "unregister"]

_owners: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(token: str, owner: Any) -> None:
    """Make ``owner`` (a strategy's extended object) findable by ``token``."""
    _owners[token] = owner


def unregister(token: str) -> None:
    _owners.pop(token, None)


def lookup(token: str) -> Any:
    """The live owner for ``token`` in this process, or ``None``."""
    return _owners.get(token)


def resolve_strategy(token: str) -> Any:
    """Unpickle a strategy reference: the replica's view inside a replica, else the live strategy.

    Raises
    ------
    StrategyClosedError
        Outside a replica of ``token``'s group, when no live strategy of this
        process has that token.
    """
    runtime = context.current_runtime()
    if runtime is not None and runtime.token == token:
        return runtime.strategy_view
    owner = lookup(token)
    if owner is None or owner.strategy is None:
        raise StrategyClosedError(f"strategy {token} is closed or lives in another process")
    return owner.strategy
