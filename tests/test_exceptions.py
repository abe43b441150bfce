"""The error tree: every daskdist error under ``DaskdistError``, with the builtin bases users catch kept."""

from __future__ import annotations

import ast
import builtins
import pathlib
import pickle

import pytest

import daskdist as dd
from daskdist import exceptions, serialization
from daskdist.elastic.recovery import is_final


def _error_classes():
    return [getattr(exceptions, name) for name in exceptions.__all__]


#: Exception classes defined outside ``exceptions.py``, each with the reason (a stale entry fails too).
DEFINED_ELSEWHERE = {
    "wire/frames.py:PeerClosed": "the wire imports nothing of daskdist (pyproject's contract): a ConnectionError",
    "wire/hello.py:WireRejected": "the wire imports nothing of daskdist (pyproject's contract): a ConnectionError",
}

BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}


def exception_classes_outside(root: pathlib.Path, home: pathlib.Path) -> list[str]:
    """``path:Class`` for every public exception class defined under ``root`` in a module other than ``home``.

    A class is an exception when a base is a builtin exception or (by name) another exception class found
    under ``root``, to a fixed point. A module-private class (``_Name``) is a signal that never leaves its
    module, and is allowed.
    """
    classes = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                classes.append((path, node.name, bases))
    exceptions_found = set(BUILTIN_EXCEPTIONS)
    while True:
        more = {name for _, name, bases in classes if bases & exceptions_found} - exceptions_found
        if not more:
            break
        exceptions_found |= more
    return [f"{path.relative_to(root).as_posix()}:{name}" for path, name, bases in classes
            if path != home and bases & exceptions_found and not name.startswith("_")]


def test_every_public_error_class_of_daskdist_is_defined_in_exceptions_py():
    """No module but ``exceptions.py`` defines a public exception class (so the tree there is the whole tree)."""
    root = pathlib.Path(dd.__file__).parent
    assert exception_classes_outside(root, root / "exceptions.py") == sorted(DEFINED_ELSEWHERE)


def test_the_scan_finds_exceptions_of_every_builtin_base_and_their_subclasses(tmp_path):
    """The scan above, on a small tree: builtin bases (the commonest ones too) and a subclass of one are found."""
    (tmp_path / "exceptions.py").write_text("class Mine(Exception):\n    pass\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import builtins\n\n"
        "class A(Exception): pass\n"
        "class B(ValueError): pass\n"
        "class C(ConnectionError): pass\n"
        "class D(builtins.NotImplementedError): pass\n"
        "class E(A): pass\n"
        "class F(E, object): pass\n"
        "class _Signal(Exception): pass\n"
        "class NotAnError: pass\n"
        "class G(NotAnError): pass\n")
    found = exception_classes_outside(tmp_path, tmp_path / "exceptions.py")
    assert found == [f"pkg/m.py:{name}" for name in "ABCDEF"]


def test_exceptions_py_lists_every_exception_class_it_defines():
    defined = {name for name, value in vars(exceptions).items()
               if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == exceptions.__name__}
    assert defined == set(exceptions.__all__)


def test_the_adapters_and_internal_modules_name_the_same_classes():
    from daskdist.collective import mailbox
    from daskdist.collective.transport import base, shm_lane
    from daskdist.elastic import boundary
    from daskdist.plugins import keras3

    assert mailbox.MailboxTimeout is exceptions.MailboxTimeout
    assert base.PayloadMismatch is exceptions.PayloadMismatch
    assert shm_lane.LaneMismatch is exceptions.LaneMismatch
    assert boundary.StopAtCommit is exceptions.StopAtCommit
    for name in ("OutsideScopeError", "UnsupportedBackendError", "UnsupportedOptimizerError", "WeightsDifferError"):
        assert getattr(keras3, name) is getattr(exceptions, name)


def test_every_error_derives_from_the_base_and_keeps_its_builtin_base():
    for cls in _error_classes():
        assert issubclass(cls, dd.DaskdistError), cls
    assert issubclass(dd.OutOfRangeError, StopIteration)
    assert issubclass(dd.CheckpointError, ValueError)
    assert issubclass(dd.StrategyClosedError, RuntimeError)
    assert issubclass(dd.RendezvousError, TimeoutError)
    assert issubclass(dd.CollectiveMismatchError, ValueError)
    assert issubclass(dd.ParameterServerLostError, dd.ReplicaLostError)
    assert issubclass(dd.ElasticRecoveryError, dd.ReplicaLostError)
    assert issubclass(exceptions.OutsideScopeError, ValueError)
    assert issubclass(exceptions.UnsupportedBackendError, ValueError)
    assert issubclass(exceptions.UnsupportedOptimizerError, NotImplementedError)
    assert issubclass(exceptions.WeightsDifferError, ValueError)
    # the old homes still name the same classes
    assert dd.data.OutOfRangeError is dd.OutOfRangeError
    assert dd.experimental.coordinator.ParameterServerLostError is dd.ParameterServerLostError
    from daskdist.keras import saving

    assert saving.CheckpointError is dd.CheckpointError


def test_the_tree_at_the_top_of_exceptions_py_names_every_error():
    lines = exceptions.__doc__.splitlines()
    assert "    DaskdistError" in lines
    for cls in _error_classes():
        if cls is not dd.DaskdistError:
            drawn = [line for line in lines if f"── {cls.__name__} " in line]
            assert len(drawn) == 1, cls


@pytest.mark.parametrize("cls", [dd.ReplicaLostError, dd.ParameterServerLostError, dd.ElasticRecoveryError])
def test_a_loss_crosses_the_wire_with_its_class_and_worker(cls):
    error = cls("lost tcp://w:1", worker="tcp://w:1")
    again = serialization.exception_from_message(serialization.error_message(error, 0, "tcp://w:1"))
    assert type(again) is cls and again.worker == "tcp://w:1"
    assert type(pickle.loads(pickle.dumps(error))) is cls


def test_the_end_of_an_elastic_run_is_its_own_class_not_an_attribute():
    assert is_final(dd.ElasticRecoveryError("too few workers", worker="tcp://w:1"))
    assert not is_final(dd.ReplicaLostError("lost", worker="tcp://w:1"))
    assert not is_final(dd.ParameterServerLostError("ps lost"))
