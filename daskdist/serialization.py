"""Pickling of commands and results, and errors that travel from replicas to the client.

Functions travel with ``cloudpickle`` (so notebook and ``__main__`` functions
work); large arrays use pickle protocol 5. Handlers never raise across the
wire: a replica answers with an error message that the client turns back
into the original exception (or a faithful stand-in when it cannot be
unpickled), with the replica's traceback attached as a note.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

import cloudpickle

from daskdist.exceptions import DaskdistError, kind_of

__all__ = ["add_note", "dumps", "error_message", "exception_from_message", "loads"]


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (PEP 678) on Python 3.11+; on 3.10, which lacks the method, the same
    ``__notes__`` list is kept (3.10's traceback module does not print it)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` (functions by value where needed)."""
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle what ``dumps`` wrote."""
    return pickle.loads(data)


def error_message(error: BaseException, rank: int, worker: str) -> dict:
    """Describe ``error`` raised on replica ``rank`` as a msgpack-able message.

    ``kind`` is ``"user"`` for an exception from user code, else the
    daskdist error kind (``lost``, ``mismatch``, ``timeout``, ``aborted``).
    """
    kind = kind_of(error) if isinstance(error, DaskdistError) else "user"
    pickled: bytes | None
    try:
        pickled = dumps(error)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    return {
        "status": "error",
        "kind": kind,
        "rank": rank,
        "worker": worker,
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
        "exception": pickled,
    }


def exception_from_message(msg: dict) -> BaseException:
    """Rebuild the exception described by ``error_message`` (with the remote traceback as a note)."""
    error: BaseException | None = None
    if msg.get("exception") is not None:
        try:
            error = loads(msg["exception"])
        except Exception:
            error = None
    if error is None:
        error = RuntimeError(f"{msg.get('type', 'Exception')}: {msg.get('message', '')}")
    where = f"replica {msg.get('rank')} on worker {msg.get('worker')}"
    if msg.get("traceback"):
        add_note(error, f"Raised on {where}:\n{msg['traceback'].rstrip()}")
    else:
        add_note(error, f"Raised on {where}")
    return error
