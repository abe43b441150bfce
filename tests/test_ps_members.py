"""Parameter stores as group members with role ``ps``: membership, downscaling protection, loss announcement."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers

ClusterCoordinator = dd.experimental.coordinator.ClusterCoordinator


def _resolver(ps, workers):
    return dd.cluster_resolver.SimpleClusterResolver(dd.cluster_resolver.ClusterSpec({"ps": ps, "worker": workers}))


def _ordered(client):
    info = scheduler_workers(client)
    return sorted(info, key=lambda a: info[a]["name"])


def _store_group(dask_scheduler, group_id):
    group = dask_scheduler.extensions["daskdist"].groups.get(group_id)
    if group is None:
        return None
    return {"status": group.status, "workers": list(group.workers),
            "roles": [m.role for m in group.membership.members]}


def _hosted_members(dask_worker):
    return sorted(dask_worker.extensions["daskdist"].members)


def _closable(dask_scheduler):
    return sorted(dask_scheduler.workers_to_close(n=len(dask_scheduler.workers)))


def test_each_ps_is_a_member_with_role_ps_and_leaves_the_group_when_the_strategy_closes(threaded_client):
    client = threaded_client
    ps, worker, _free = _ordered(client)
    strategy = dd.ParameterServerStrategy(_resolver([ps], [worker]), client=client)
    group_id = strategy.extended.store_group.group_id
    with strategy.scope():
        v = dd.Variable(np.arange(4.0), name="v")
    assert group_id == f"ps-{strategy.extended.token}"
    group = client.run_on_scheduler(_store_group, group_id=group_id)
    assert group == {"status": "running", "workers": [ps], "roles": ["ps"]}
    assert client.run(_hosted_members, workers=[ps])[ps] == [group_id]
    store = strategy.extended.stores[0]
    assert store.address == ps
    assert sorted(store.call_from_client(client, "versions")) == [v._var_id]
    strategy.close()
    assert client.run_on_scheduler(_store_group, group_id=group_id) is None
    assert client.run(_hosted_members, workers=[ps])[ps] == []
    assert store.call_from_client(client, "versions") == {}  # the member dropped the strategy's variables


def test_the_scheduler_does_not_retire_a_ps_while_its_strategy_lives(threaded_client):
    client = threaded_client
    ps, worker, free = _ordered(client)
    assert client.run_on_scheduler(_closable) == sorted([ps, worker, free])
    with dd.ParameterServerStrategy(_resolver([ps], [worker]), client=client):
        closable = client.run_on_scheduler(_closable)
        assert ps not in closable  # downscaling protection: a member of a live group
        assert free in closable
    assert ps in client.run_on_scheduler(_closable)


@pytest.mark.slow
def test_a_killed_ps_is_announced_as_a_lost_member_and_the_coordinator_raises_promptly(make_cluster):
    client = make_cluster(3, processes=True)
    ps, worker, _free = _ordered(client)
    with dd.ParameterServerStrategy(_resolver([ps], [worker]), client=client) as strategy:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            v = dd.Variable(np.zeros(()), name="v")
        coordinator.schedule(lambda: v.assign_add(1.0))
        coordinator.join()
        group_id = strategy.extended.store_group.group_id
        os.kill(client.run(os.getpid, workers=[ps])[ps], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(dd.ParameterServerLostError, match="parameter server") as raised:
            while time.monotonic() - start < 60:
                coordinator.done()
                time.sleep(0.05)
        assert time.monotonic() - start < 20  # announced within about a second: 20 s is load's margin
        assert raised.value.worker == ps
        assert isinstance(raised.value, dd.ReplicaLostError)
        assert strategy.extended.store_group.status()[0] == "failed"
        failed = [msg for _, msg in client.get_events("daskdist")
                  if msg.get("action") == "failed" and msg.get("group") == group_id]
        assert failed and failed[0]["worker"] == ps  # announced by the scheduler plugin, like any lost member
        with pytest.raises(dd.ParameterServerLostError):
            coordinator.schedule(lambda: None)
