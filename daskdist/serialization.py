"""Pickling of commands and results, and errors that travel from replicas to the client.

Functions travel with ``cloudpickle`` (so notebook and ``__main__`` functions
work); large arrays use pickle protocol 5. Handlers never raise across the
wire: a replica answers with an error message that the client turns back
into the original exception (or a faithful stand-in when it cannot be
unpickled), with the replica's traceback attached as a note.
"""

from __future__ import annotations

import functools
import importlib
import io
import pickle
import sys
import traceback
import types
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


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is unannotated here
    """cloudpickle's pickler that also ships module objects of a ``ModuleType`` subclass by reference.

    cloudpickle pickles modules by name (or by value, for a dynamic one),
    but it picks that reducer by exact type: a package's submodule object of
    its own module class (``torch.ops``, a ``torch._ops._Ops``, which a
    function using ``keras.ops`` and ``torch`` makes cloudpickle ship) would
    otherwise be pickled as a plain object, which fails.
    """

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                and sys.modules.get(getattr(obj, "__name__", "")) is obj):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` (functions by value where needed; importable modules by name).

    Raises
    ------
    TypeError
        ``obj`` holds something that cannot be pickled; for a function, the message names the global or
        captured variable that cannot, and how to ship it.
    """
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except (TypeError, pickle.PicklingError, AttributeError) as error:
        culprit = _unpicklable_reference(obj)
        if culprit is None:
            raise
        raise TypeError(f"{culprit}: {error}. Import it inside the function (or pass it as an argument), or "
                        "define it in a module the workers can import") from error
    return buffer.getvalue()


def _unpicklable_reference(obj: Any, depth: int = 0, seen: set[int] | None = None) -> str | None:
    """Which global or captured variable of a function in ``obj`` cannot be pickled (``None``: none found)."""
    seen = set() if seen is None else seen
    if depth > 4 or id(obj) in seen:
        return None
    seen.add(id(obj))
    if isinstance(obj, functools.partial):
        return _unpicklable_reference((obj.func, obj.args, obj.keywords), depth + 1, seen)
    if isinstance(obj, (tuple, list)):
        items: list[Any] = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, types.FunctionType):
        code = obj.__code__
        referenced = {name: obj.__globals__[name] for name in code.co_names if name in obj.__globals__}
        referenced.update({name: cell.cell_contents for name, cell in zip(code.co_freevars, obj.__closure__ or ())
                           if _has_contents(cell)})
        for name, value in referenced.items():
            if isinstance(value, types.FunctionType):
                found = _unpicklable_reference(value, depth + 1, seen)
                if found is not None:
                    return found
                continue
            try:
                _Pickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
            except Exception:
                return (f"function {obj.__qualname__!r} (module {obj.__module__!r}) cannot be shipped to the "
                        f"replicas: it uses {name!r} ({type(value).__module__}.{type(value).__qualname__}), "
                        "which cannot be pickled")
        return None
    else:
        return None
    for item in items:
        found = _unpicklable_reference(item, depth + 1, seen)
        if found is not None:
            return found
    return None


def _has_contents(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle what ``dumps`` wrote."""
    return pickle.loads(data)


def error_message(error: BaseException, rank: int, worker: str) -> dict[str, Any]:
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


def exception_from_message(msg: dict[str, Any]) -> BaseException:
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
