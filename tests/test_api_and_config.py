"""Public API surface, values, and configuration through dask.config."""

from __future__ import annotations

import os
import subprocess
import sys

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import config
from daskdist.values import regroup


def test_all_is_sorted_and_complete():
    assert list(dd.__all__) == sorted(dd.__all__)
    for name in dd.__all__:
        assert hasattr(dd, name), name


def test_reduce_op_accepts_strings():
    assert dd.ReduceOp.from_any("sum") is dd.ReduceOp.SUM
    assert dd.ReduceOp("MEAN") is dd.ReduceOp.MEAN
    with pytest.raises(ValueError, match="Unknown reduce op"):
        dd.ReduceOp.from_any("median")


def test_communication_options():
    options = dd.CommunicationOptions(bytes_per_pack=1024, timeout_seconds=5, implementation="ring")
    assert options.implementation is dd.CommunicationImplementation.RING
    with pytest.raises(ValueError):
        dd.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError):
        dd.CommunicationOptions(timeout_seconds=-1)
    assert dd.CommunicationOptions(timeout_seconds=0).timeout_seconds == 0  # TF: zero disables the timeout
    with pytest.raises(ValueError):
        dd.CommunicationOptions(implementation="carrier-pigeon")
    merged = dd.CommunicationOptions(timeout_seconds=3).merge(dd.CommunicationOptions(bytes_per_pack=8))
    assert merged.timeout_seconds == 3 and merged.bytes_per_pack == 8


def test_values_reduce_and_regroup():
    per = dd.PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    strategy = dd.get_strategy()  # the default one-replica strategy outside any scope
    assert strategy.num_replicas_in_sync == 1
    from daskdist.values import gather_values, reduce_values

    assert reduce_values("SUM", per, None, 2).tolist() == [4.0, 6.0]
    assert reduce_values("MEAN", per, 0, 2).tolist() == 2.5  # mean over every element
    assert gather_values(per, 0).tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="non-DistributedValues value"):
        reduce_values("SUM", np.ones(2), None, 2)
    grouped = regroup([{"a": 1, "b": (2, 3)}, {"a": 4, "b": (5, 6)}])
    assert grouped["a"].values == (1, 4) and grouped["b"][1].values == (3, 6)
    assert regroup([None, None]) is None  # TF: an object every replica returned comes back unwrapped
    assert regroup([[True, 7], [True, 7]]) == [True, 7]  # singletons and small ints: one object in CPython too
    assert regroup(["same", "same"]).values == ("same", "same")  # strings, floats, arrays: per replica
    assert regroup([1.5, 1.5]).values == (1.5, 1.5)
    assert "PerReplica" in repr(per) and "<table>" in per._repr_html_()


def test_default_replica_context_outside_strategies():
    ctx = dd.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert ctx.all_reduce("SUM", 5.0) == 5.0
    assert ctx.merge_call(lambda s, x: x + 1, args=(1,)) == 2
    assert not dd.has_strategy() and not dd.in_cross_replica_context()


def test_config_defaults_and_overrides():
    assert config.get_seconds("collective.timeout") == 300
    with dask.config.set({"daskdist.collective.timeout": "2 minutes"}):
        assert config.get_seconds("collective.timeout") == 120


def test_config_from_environment_variables():
    code = "import daskdist.config as c; print(c.get_seconds('rendezvous.timeout'))"
    env = dict(os.environ, DASK_DASKDIST__RENDEZVOUS__TIMEOUT="7s")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7.0"
