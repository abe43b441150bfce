"""Replica groups on real clusters: membership generations, stale messages, residents, settings, downscaling."""

from __future__ import annotations

import glob
import os
import signal
import time

import dask
import dask.array as da
import numpy as np
import pytest

import daskdist as dd
from daskdist import keras, serialization
from daskdist.cluster.identity import scheduler_workers
from daskdist.group.membership import Member, Membership

Dataset = dd.data.Dataset

ELASTIC = {"daskdist.group.membership-policy": "elastic"}

#: Commands that ran in this process (the threaded cluster's workers are threads here).
_RAN: list[int] = []

def _everywhere(strategy, out):
    """The one value every replica returned (``strategy.run`` gives it once when all are equal, as TF's regroup)."""
    values = strategy.experimental_local_results(out)
    assert all(repr(v) == repr(values[0]) for v in values), values
    return values[0]



def _record(runtime, value):
    _RAN.append(value)
    return value


def _change_membership(client, group_id, workers):
    return client.sync(client.scheduler.daskdist_change_membership, group_id=group_id, workers=list(workers),
                       reason="test")


def _segments(group_id, generation):
    return glob.glob(f"/dev/shm/daskdist-{group_id.rsplit('-', 1)[-1]}g{generation}-*")


def test_membership_is_frozen_and_names_ranks_by_role():
    members = (Member("tcp://a:1", "/cpu:0", "h1", "ps"), Member("tcp://b:1", "/cpu:0", "h1", "worker"),
               Member("tcp://c:1", "/cpu:0", "h2", "worker"))
    membership = Membership("daskdist-x", 0, members)
    assert membership.ranks("worker") == [1, 2] and membership.ranks() == [0, 1, 2]
    assert membership.rank_of("tcp://c:1") == 2
    assert Membership.from_msg(membership.to_msg()) == membership
    nxt = membership.next(members[1:])
    assert (nxt.generation, nxt.size, nxt.wire_id) == (1, 2, "daskdist-xg1")
    with pytest.raises(AttributeError):
        membership.generation = 3
    with pytest.raises(ValueError, match="role"):
        Member("tcp://a:1", "/cpu:0", "h1", "boss")
    with pytest.raises(ValueError, match="not a member"):
        nxt.rank_of("tcp://a:1")


def test_messages_of_a_stale_generation_are_rejected_never_consumed(threaded_client):
    with dask.config.set(ELASTIC), dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        workers = list(group.addresses)
        old = group.membership
        answer = _change_membership(threaded_client, group.group_id, workers)
        assert answer["status"] == "OK" and answer["membership"]["generation"] == 1
        assert group.refresh_membership().generation == 1
        assert _everywhere(strategy, strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(3)))).tolist() == [3] * 3

        # a command of generation 0 sent straight to a worker: rejected, and the command never runs
        _RAN.clear()
        payload = serialization.dumps((_record, (7,), 0))
        response = threaded_client.sync(threaded_client.rpc(workers[0]).daskdist_call, group_id=group.group_id,
                                        generation=0, rank=0, run_id=10_000, payload=payload)
        assert response["status"] == "error" and response["kind"] == "stale"
        assert "generation 0" in response["message"] and "generation 1" in response["message"]
        assert _RAN == []

        # the client's own handle at a stale generation raises StaleGenerationError, on every replica
        group.membership = old
        with pytest.raises(dd.StaleGenerationError, match="rejected"):
            strategy.run(lambda: _RAN.append(1))
        assert _RAN == []
        group.refresh_membership()
        assert _everywhere(strategy, strategy.run(lambda: 5)) == 5

        # the scheduler's rendezvous and keyed exchange reject generation 0 too
        for handler, kwargs in [("daskdist_rendezvous", {"rank": 0, "address": workers[0], "info": {}}),
                                ("daskdist_exchange", {"key": "k", "rank": 0, "value": 1, "timeout": 0.1}),
                                ("daskdist_membership", {})]:
            answer = threaded_client.sync(getattr(threaded_client.scheduler, handler), group_id=group.group_id,
                                          generation=0, **kwargs)
            assert answer["status"] == "error" and answer["kind"] == "stale", handler

        # a peer's data message of generation 0 is dropped, not put in the mailbox of generation 1
        def deliver(dask_worker, group_id):
            import time

            from daskdist.collective.mailbox import MailboxTimeout

            plugin = dask_worker.extensions["daskdist"]
            runtime = plugin.replicas[group_id]
            stale, current = (10**9, 0, 1, "old"), (10**9, 0, 1, "new")
            plugin.message(group_id, runtime.rank, list(stale), "from generation 0", generation=0)
            plugin.message(group_id, runtime.rank, list(current), "from generation 1", generation=1)
            got = runtime.mailbox.take(current, time.monotonic() + 5)
            try:
                runtime.mailbox.take(stale, time.monotonic() + 0.2)
            except MailboxTimeout:
                return got, None
            return got, "consumed"

        answer = threaded_client.run(deliver, group_id=group.group_id, workers=[workers[0]])
        assert answer == {workers[0]: ("from generation 1", None)}

        # the same command at the current generation does run (so the rejection above is what stopped it)
        assert group.call(_record, (8,)) == [8, 8, 8] and _RAN == [8, 8, 8]


def test_a_fixed_group_fails_everywhere_when_its_membership_changes(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        answer = _change_membership(threaded_client, group.group_id, group.addresses[:2])
        assert answer["status"] == "OK"
        with pytest.raises(dd.ReplicaLostError, match="policy is fixed"):
            strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(2)))
        with pytest.raises(dd.StrategyClosedError):
            strategy.run(lambda: 1)


def test_handles_and_datasets_made_before_a_generation_change_resolve_after_it(threaded_client):
    x = da.from_array(np.arange(48, dtype=np.float32).reshape(24, 2), chunks=(4, 2))
    with dask.config.set(ELASTIC), dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        with strategy.scope():
            v = dd.Variable(np.zeros(3, np.float32), aggregation=dd.VariableAggregation.MEAN)
        dist = strategy.experimental_distribute_dataset(Dataset.from_dask(x).batch(6))
        token = strategy.extended.token
        assert token != group.group_id  # the strategy's identity is not the group's

        def sums(batch):
            return dd.get_replica_context().all_reduce("SUM", batch.sum(0))

        before = [strategy.experimental_local_results(strategy.run(sums, args=(b,)))[0].tolist() for b in dist]
        strategy.run(lambda: v.assign_add(np.ones(3, np.float32)))
        assert len(_segments(group.group_id, 0)) == 6

        # the scheduler plugin's API moves the group to generation 1 (ranks reversed); the client learns it
        seen = []
        group.on_membership(seen.append)
        _change_membership(threaded_client, group.group_id, list(reversed(group.addresses)))
        group.refresh_membership()
        assert [m.generation for m in seen] == [1]
        assert strategy.extended.token == token

        # the variable handle made in generation 0 resolves on every replica of generation 1
        strategy.run(lambda: v.assign_add(np.ones(3, np.float32)))
        assert v.read_value().tolist() == [2.0] * 3
        assert [r.tolist() for r in strategy.extended.read_variable(v._var_id, all_replicas=True)] == [[2.0] * 3] * 3
        ranks = strategy.run(lambda: dd.get_replica_context().replica_id_in_sync_group).values
        assert sorted(ranks) == [0, 1, 2]
        # the distributed dataset made in generation 0 iterates again, with the same all-reduced sums
        after = [strategy.experimental_local_results(strategy.run(sums, args=(b,)))[0].tolist() for b in dist]
        assert after == before
        # nothing of generation 0's wiring is left: its segments are gone, generation 1 has its own
        assert _segments(group.group_id, 0) == [] and len(_segments(group.group_id, 1)) == 6


def _cnn():
    model = keras.Sequential([
        keras.layers.Dense(8, activation="relu", input_shape=(4,)),
        keras.layers.Dense(3),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(0.05))
    return model


def _assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        left, right = a[key], b[key]
        if isinstance(left, dict):
            _assert_bit_equal(left, right)
        elif isinstance(left, list):
            assert len(left) == len(right)
            for p, q in zip(left, right):
                _assert_bit_equal({"x": p}, {"x": q})
        else:
            left, right = np.asarray(left), np.asarray(right)
            assert left.dtype == right.dtype and left.shape == right.shape, key
            assert left.tobytes() == right.tobytes(), key


def test_a_resident_snapshot_restores_variables_and_optimizer_slots_bit_for_bit(threaded_client):
    rng = np.random.default_rng(0)
    x, y = rng.random((120, 4)).astype(np.float32), rng.integers(0, 3, 120)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        group = strategy.extended.group
        with strategy.scope():
            model = _cnn()
            v = dd.Variable(np.arange(4, dtype=np.float64), aggregation=dd.VariableAggregation.MEAN)
        train = Dataset.from_tensor_slices((x, y)).batch(20)
        model.fit(train, epochs=2, verbose=0)
        strategy.run(lambda: v.assign_add(np.full(4, 0.1)))
        assert {"variable", "model", "dataset"} <= {kind for kind, _ in group.snapshot_residents()[0]}
        weights = ("variable", "model")  # each fit makes a new dataset: compare what the snapshot is about
        saved = group.snapshot_residents(weights)
        assert {kind for kind, _ in saved[0]} == set(weights)
        model_state = next(s for (kind, _), s in saved[0].items() if kind == "model")
        assert any(k.startswith("m/") for k in model_state["optimizer"])  # Adam's slots are in it
        assert all(np.any(np.asarray(s) != 0) for k, s in model_state["optimizer"].items() if k.startswith("m/"))

        model.fit(train, epochs=1, verbose=0)  # weights, slots and iterations move on
        strategy.run(lambda: v.assign(np.full(4, -1.0)))
        moved = group.snapshot_residents(weights)
        with pytest.raises(AssertionError):
            _assert_bit_equal(saved[0], moved[0])

        group.restore_residents(saved)
        restored = group.snapshot_residents(weights)
        _assert_bit_equal(saved[0], restored[0])
        _assert_bit_equal(saved[1], restored[1])
        assert v.read_value().tolist() == (np.arange(4) + 0.1).tolist()
        with pytest.raises(KeyError, match="holds no such residents"):
            group.restore_residents({("variable", "c999"): np.zeros(4)})


def _replica_setting(key):
    from daskdist import config

    return config.get(key)


def test_replicas_read_the_clients_settings_not_the_workers(make_cluster):
    client = make_cluster(2, processes=True)
    # set only on the workers: must not change the replicas
    client.run(lambda: dask.config.set({"daskdist.collective.transport": "socket",
                                        "daskdist.collective.stall-warning": "99s"}))
    # set only on the client: must reach the replicas
    with dask.config.set({"daskdist.collective.small-message-bytes": 12345}), dd.MirroredStrategy(client=client) as strategy:
        assert client.run(lambda: dask.config.get("daskdist.collective.small-message-bytes")) == dict.fromkeys(
            strategy.extended.worker_addresses, 65536)
        assert _everywhere(strategy, strategy.run(_replica_setting, args=("collective.small-message-bytes",))) == 12345
        assert _everywhere(strategy, strategy.run(_replica_setting, args=("collective.transport",))) == "auto"
        assert _everywhere(strategy, strategy.run(_replica_setting, args=("collective.stall-warning",))) == "10s"

        def routes():  # the same structure on every replica (different ones are refused, as in TensorFlow)
            return ",".join(sorted(dd.get_replica_context()._runtime.transport.describe().values()))

        assert strategy.run(routes).values == ("shm", "shm")  # the client's "auto", not the workers' socket
        # a later dask.config.set on the client reaches the replicas with the next command, and its end too
        with dask.config.set({"daskdist.collective.small-message-bytes": 777}):
            assert _everywhere(strategy, strategy.run(_replica_setting, args=("collective.small-message-bytes",))) == 777
        assert _everywhere(strategy, strategy.run(_replica_setting, args=("collective.small-message-bytes",))) == 12345


def _downscaling_candidates(dask_scheduler):
    plugin = dask_scheduler.extensions["daskdist"]
    return sorted(ws.address for ws in plugin.valid_workers_downscaling(dask_scheduler,
                                                                        list(dask_scheduler.workers.values())))


def test_workers_of_a_group_are_protected_from_downscaling(make_cluster):
    client = make_cluster(3, processes=False)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client) as strategy:
        members = set(strategy.extended.worker_addresses)
        everyone = set(scheduler_workers(client))
        (outsider,) = everyone - members
        assert client.run_on_scheduler(_downscaling_candidates) == [outsider]
        # Dask's own downscaling (retire_workers with a count) takes the outsider only, though asked for two
        retired = client.retire_workers(n=2, close_workers=True)
        assert set(retired) == {outsider}
        assert _everywhere(strategy, strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(2)))).tolist() == [2, 2]
    # once the group is closed its workers may go
    assert client.run_on_scheduler(_downscaling_candidates) == sorted(members)



@pytest.mark.slow
def test_an_elastic_group_re_forms_on_the_survivors_of_a_killed_worker(make_cluster):
    client = make_cluster(3, processes=True)
    with dask.config.set(ELASTIC):
        strategy = dd.MirroredStrategy(client=client)
    with strategy:
        group = strategy.extended.group
        assert _everywhere(strategy, strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(2)))).tolist() == [3, 3]
        victim = group.addresses[2]
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            answer = client.sync(client.scheduler.daskdist_membership, group_id=group.group_id)
            if answer["membership"]["generation"] == 1:
                break
            time.sleep(0.1)
        assert [m[0] for m in answer["membership"]["members"]] == group.addresses[:2]
        # the handle still at generation 0 is refused (or sees the loss), never served by the old wiring
        with pytest.raises((dd.StaleGenerationError, dd.ReplicaLostError)):
            strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(2)))
        assert group.refresh_membership().generation == 1
        out = strategy.run(lambda: [dd.get_replica_context().num_replicas_in_sync,
                                    dd.get_replica_context().all_reduce("SUM", np.ones(2)).tolist()])
        sizes, sums = out
        assert _everywhere(strategy, sizes) == 2
        assert [_everywhere(strategy, v) for v in sums] == [2.0, 2.0]


def test_a_new_generation_keeps_drops_or_reorders_members_but_cannot_admit_a_newcomer_yet(threaded_client):
    with dask.config.set(ELASTIC), dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        group = strategy.extended.group
        (outsider,) = set(scheduler_workers(threaded_client)) - set(group.addresses)
        answer = _change_membership(threaded_client, group.group_id, [*group.addresses, outsider])
        assert answer["status"] == "error" and "host no replica" in answer["message"]
        answer = _change_membership(threaded_client, group.group_id, [])
        assert answer["status"] == "error" and "at least one member" in answer["message"]
        # nothing changed: the group is still at generation 0 and runs
        assert group.refresh_membership().generation == 0
        assert _everywhere(strategy, strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(2)))).tolist() == [2, 2]


def test_a_wait_for_the_next_generation_is_woken_by_the_schedulers_announcement(threaded_client):
    """``wait_for_generation`` returns on the plugin's event: its re-check period (120 s) is never waited out."""
    import threading

    with dask.config.set(ELASTIC), dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        workers = list(group.addresses)
        assert group.wait_for_generation(0, timeout=0.2, recheck=120) is None  # nothing announced: times out
        changer = threading.Timer(0.5, _change_membership, (threaded_client, group.group_id, workers[::-1]))
        changer.start()
        try:
            start = time.monotonic()
            membership = group.wait_for_generation(0, timeout=60, recheck=120)
        finally:
            changer.join()
        assert membership is not None and membership.generation == 1, membership
        assert membership.addresses == workers[::-1] and group.addresses == workers[::-1]
        assert time.monotonic() - start < 60  # woken by the announcement, not by a re-check
        view = group.scheduler_view()
        assert view.membership == membership and view.retired == frozenset()
        assert view.departed(workers + ["tcp://gone:1"]) == ["tcp://gone:1"]


def test_announcements_count_changes_and_wake_waiters_of_the_group_only():
    import threading

    from daskdist.group.announcements import Announcements

    announcements = Announcements("daskdist")
    announcements.handle((0.0, {"action": "register", "group": "g"}))  # not a change
    announcements.handle((0.0, "not a dict"))
    assert announcements.version == 0 and not announcements.wait("g", 0, 0.01)
    announcements.handle((0.0, {"action": "generation", "group": "other", "generation": 3}))
    assert announcements.version == 1 and not announcements.wait("g", 0, 0.01)  # another group's generation
    assert announcements.wait("other", 2, 0.01) and not announcements.wait("other", 3, 0.01)
    woken = []
    waiter = threading.Thread(target=lambda: woken.append(announcements.wait_past(1, 30)))
    waiter.start()
    announcements.handle((0.0, {"action": "worker-added", "worker": "tcp://w:1"}))
    waiter.join(30)
    assert woken == [2]
    announcements.handle((0.0, {"action": "failed", "group": "g", "reason": "lost"}))
    assert announcements.wait("g", 10, 0.01)  # a failed group wakes its waiters (they then ask the scheduler)
