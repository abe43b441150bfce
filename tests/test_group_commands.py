"""The client's command paths on real clusters: the direct channel, Dask RPC, targets, commands in flight."""

from __future__ import annotations

import socket
import threading

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.group.channel import PROTOCOL
from daskdist.wire.hello import greeting

#: Set by one replica's command, awaited by another's (the threaded cluster's workers are threads here).
_GATES: dict[str, threading.Event] = {}

def _everywhere(strategy, out):
    """The one value every replica returned (``strategy.run`` gives it once when all are equal, as TF's regroup)."""
    values = strategy.experimental_local_results(out)
    assert all(repr(v) == repr(values[0]) for v in values), values
    return values[0]



def _wait_for_gate(runtime, name):
    if not _GATES.setdefault(name, threading.Event()).wait(30):
        raise TimeoutError(f"gate {name} was never opened")
    return runtime.rank


def _open_gate(runtime, name):
    _GATES.setdefault(name, threading.Event()).set()
    return runtime.rank


def _raise_key_error(runtime):
    raise KeyError("submitted and failed")


def _rank(runtime):
    return runtime.rank


@pytest.mark.parametrize("channel", ["direct", "dask"])
def test_both_command_paths_run_steps_and_carry_errors(threaded_client, channel):
    with dask.config.set({"daskdist.client.command-channel": channel}), \
            dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        assert group.command_path == channel
        out = strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(1024, np.float32)))
        assert all(v.tolist() == [3.0] * 1024 for v in strategy.experimental_local_results(out))

        def fails():
            if dd.get_replica_context().replica_id_in_sync_group == 1:
                raise KeyError("only on replica 1")
            return dd.get_replica_context().all_reduce("SUM", np.ones(2))

        with pytest.raises(KeyError, match="only on replica 1"):
            strategy.run(fails)
        assert _everywhere(strategy, strategy.run(lambda: 4)) == 4  # the group goes on after a user error


def test_calls_target_all_a_role_or_one_member(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        assert group.call(_rank) == [0, 1, 2]
        assert group.call(_rank, role="replica") == [0, 1, 2]
        assert group.call(_rank, role="ps") == []
        assert group.call(_rank, member=1) == [1]
        assert group.submit(_rank, member=2).result(30) == [2]
        with pytest.raises(TypeError, match="at most one"):
            group.call(_rank, ranks=[0], member=1)
        with pytest.raises(ValueError, match="not a rank"):
            group.call(_rank, member=3)


def test_submitted_commands_are_in_flight_together(threaded_client):
    _GATES.clear()
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        # member 0 waits until member 1 opens the gate: only commands in flight at once can both finish
        waiting = group.submit(_wait_for_gate, ("a",), member=0)
        opening = group.submit(_open_gate, ("a",), member=1)
        assert opening.result(30) == [1]
        assert waiting.result(30) == [0]
        # a submitted command's failure comes back through its future, and the group goes on
        failing = group.submit(_raise_key_error, member=2)
        with pytest.raises(KeyError, match="submitted"):
            failing.result(30)
        assert group.call(_rank) == [0, 1, 2]


def test_the_direct_channel_refuses_a_connection_without_the_groups_secret(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group

        def endpoints(dask_scheduler, group_id):
            return {r: i["command"] for r, i in dask_scheduler.extensions["daskdist"].groups[group_id].info.items()}

        host, port = threaded_client.run_on_scheduler(endpoints, group_id=group.group_id)[0]
        with socket.create_connection((host, port), timeout=10) as intruder:
            intruder.sendall(greeting(PROTOCOL, "0" * 32))  # the right protocol, not the group's secret
            assert intruder.recv(16) == b""  # closed by the replica
        assert strategy.run(lambda: dd.get_replica_context().replica_id_in_sync_group).values == (0, 1, 2)
