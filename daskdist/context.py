"""Which strategy and which replica the current thread is in (TF's cross-replica / replica contexts).

The state is a per-thread stack of frames, as in TensorFlow: ``strategy.scope()``
pushes a cross-replica frame on the client; the replica runtime pushes a
replica frame around each function it runs in a replica thread. Threads are
the unit because several replicas can share one process (threaded workers).

This module sits below the strategies and the replica runtime: it imports
neither. Outside any strategy it falls back to the default one-replica
strategy and replica context that ``daskdist.strategy.extended.default`` installs
(:func:`install_defaults`) when ``daskdist`` is imported.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from daskdist.ops import CommunicationOptions, ReduceOp

__all__ = [
    "describe_strategy",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class ReplicaContextAPI(Protocol):
    """What a function running on a replica may ask of its replica context (TF's ``ReplicaContext`` API).

    ``daskdist.ReplicaContext`` (a replica's context) and the default
    one-replica context both implement it.
    """

    @property
    def strategy(self) -> Any: ...

    @property
    def replica_id_in_sync_group(self) -> int: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def devices(self) -> tuple[str, ...]: ...

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None) -> Any: ...

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any: ...

    def broadcast(self, value: Any, root: int = 0, options: CommunicationOptions | None = None) -> Any: ...

    def reduce_scatter(self, reduce_op: ReduceOp | str, value: Any, axis: int = 0,
                       options: CommunicationOptions | None = None) -> Any: ...

    def barrier(self, options: CommunicationOptions | None = None) -> None: ...

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (),
                   kwargs: dict[str, Any] | None = None) -> Any: ...


@dataclass
class Frame:
    """One entry of the context stack.

    Attributes
    ----------
    strategy
        The strategy in effect (client strategy, or the replica's view of it).
    replica_context
        The ``ReplicaContext`` when in replica context, ``None`` in cross-replica context.
    variable_creator
        What ``dd.Variable(...)`` calls to build a distributed variable, or ``None``.
    owner
        The replica runtime when the frame was pushed inside a replica thread.
    """

    strategy: Any
    replica_context: ReplicaContextAPI | None
    variable_creator: Callable[..., Any] | None
    owner: Any = None


_local = threading.local()


@dataclass(frozen=True)
class _Defaults:
    strategy: Callable[[], Any]
    replica_context: Callable[[], ReplicaContextAPI]


_defaults: _Defaults | None = None


def install_defaults(strategy: Callable[[], Any], replica_context: Callable[[], ReplicaContextAPI]) -> None:
    """Set what :func:`get_strategy` and :func:`get_replica_context` return outside any strategy.

    ``daskdist.strategy.extended.default`` installs TF's default strategy (one local
    replica) when ``daskdist`` is imported; this module never imports it.
    """
    global _defaults
    _defaults = _Defaults(strategy, replica_context)


def _installed_defaults() -> _Defaults:
    if _defaults is None:
        raise RuntimeError("no default strategy is installed: import daskdist (daskdist.strategy.extended.default installs it)")
    return _defaults


def _stack() -> list[Frame]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_frame() -> Frame | None:
    """The innermost frame of this thread, or ``None`` outside any strategy."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def enter(frame: Frame) -> Iterator[Frame]:
    """Push ``frame`` for the duration of the ``with`` block."""
    stack = _stack()
    stack.append(frame)
    try:
        yield frame
    finally:
        stack.pop()


def current_runtime() -> Any:
    """The replica runtime whose function this thread is running, or ``None``."""
    for frame in reversed(_stack()):
        if frame.owner is not None:
            return frame.owner
    return None


def get_replica_context() -> ReplicaContextAPI | None:
    """The current ``ReplicaContext``.

    Inside a function run by ``strategy.run`` this is the replica's context;
    inside ``strategy.scope()`` on the client (cross-replica context) it is
    ``None``; outside any strategy it is a default context with one replica.
    """
    frame = current_frame()
    if frame is None:
        return _installed_defaults().replica_context()
    return frame.replica_context


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (or a ``merge_call``) but not in a replica function."""
    frame = current_frame()
    return frame is not None and frame.replica_context is None


def get_strategy() -> Any:
    """The strategy in effect: the scope's, the replica's, or the default one-replica strategy."""
    frame = current_frame()
    if frame is None:
        return _installed_defaults().strategy()
    return frame.strategy


def has_strategy() -> bool:
    """True when a non-default strategy is in effect in this thread (not inside the default one's ``merge_call``)."""
    frame = current_frame()
    return frame is not None and not getattr(frame.strategy, "is_default_strategy", False)


def experimental_set_strategy(strategy: Any) -> None:
    """Make ``strategy`` current in this thread without a ``with strategy.scope()`` block (TF's function).

    ``experimental_set_strategy(None)`` leaves it again. As in TensorFlow it
    raises ``RuntimeError`` inside a ``strategy.scope()`` (other than one it set).
    """
    entered = getattr(_local, "set_strategy_scope", None)
    stack = _stack()
    if len(stack) > (1 if entered is not None else 0):
        raise RuntimeError("Must not be called inside a `tf.distribute.Strategy` scope.")
    if entered is not None:
        _local.set_strategy_scope = None
        entered.__exit__(None, None, None)
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _local.set_strategy_scope = scope


def describe_strategy(strategy: Any) -> str:
    """A strategy's class, replica count and token: two strategies on one cluster are told apart."""
    extended = getattr(strategy, "extended", None)
    token = getattr(extended, "token", None)
    replicas = getattr(strategy, "num_replicas_in_sync", "?")
    suffix = f" {token}" if token is not None else ""
    return f"<{type(strategy).__name__}{suffix} replicas={replicas}>"


@dataclass
class Shipment:
    """What ``strategy.run`` is sending: the strategy, and objects sent along with their full state."""

    strategy: Any
    sent_in_full: list[Any]


@contextlib.contextmanager
def shipping_to(strategy: Any) -> Iterator[Shipment]:
    """Mark that this thread is sending a function (and its arguments) to ``strategy``'s replicas.

    A distributed variable pickled meanwhile checks that it belongs to that
    strategy (:func:`shipping_target`), so using strategy A's variable in
    strategy B's ``run`` fails on the client, naming both. A model or
    optimizer of the strategy pickles as a reference to the replicas' copy,
    carrying itself the first time (it notes itself in ``sent_in_full``).
    """
    previous = getattr(_local, "shipping", None)
    shipment = Shipment(strategy, [])
    _local.shipping = shipment
    try:
        yield shipment
    finally:
        _local.shipping = previous


def current_shipment() -> Shipment | None:
    """The shipment ``strategy.run`` is pickling in this thread, or ``None``."""
    return getattr(_local, "shipping", None)


def shipping_target() -> Any:
    """The strategy whose ``run`` is pickling its function in this thread, or ``None``."""
    shipment = current_shipment()
    return shipment.strategy if shipment is not None else None
