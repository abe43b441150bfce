"""The error tree: every daskdist error under ``DaskdistError``, with the builtin bases users catch kept."""

from __future__ import annotations

import ast
import pathlib
import pickle

import pytest

import daskdist as dd
from daskdist import exceptions, serialization
from daskdist.elastic.recovery import is_final


def _error_classes():
    return [getattr(exceptions, name) for name in exceptions.__all__]


def test_every_error_class_of_daskdist_is_defined_in_exceptions_py():
    """No module but ``exceptions.py`` defines an exception class (so the tree there is the whole tree)."""
    root = pathlib.Path(dd.__file__).parent
    builtin_errors = {name for name in dir(__builtins__ if isinstance(__builtins__, dict) else __builtins__)}
    elsewhere = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "exceptions.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if any(b.endswith(("Error", "Exception")) and (b in builtin_errors or hasattr(exceptions, b))
                       for b in bases):
                    elsewhere.append(f"{path.relative_to(root)}:{node.name}")
    assert elsewhere == []


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
    with pytest.raises(dd.ReplicaLostError):  # code that catches losses still catches it
        raise dd.ElasticRecoveryError("max_failures=0 is exhausted")
