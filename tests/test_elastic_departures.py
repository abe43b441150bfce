"""How members leave an elastic group: stopped (SIGSTOP) ones fenced out, failing ones cooled down, a kill mid-copy.

Real ``dask worker`` processes (each with its nanny), as in ``test_elastic.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers
from daskdist.elastic.quarantine import Quarantine
from daskdist.elastic.replica import STATE_KINDS, Commit, CommitRing, state_digest
from daskdist.group.service import ResidentStore
from tests.support import models
from tests.support.killers import wait_for_step
from tests.support.models import slow_batch

Dataset = dd.data.Dataset

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_a_stopped_worker_and_its_nanny_are_declared_lost_within_seconds_and_fit_finishes(process_workers):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)
    strategy = dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2))
    stopped: list[int] = []
    try:
        with strategy:
            with strategy.scope():
                model = models.model()
            victim = strategy.extended.worker_addresses[1]
            pids = [pid for pid in workers.pids(victim) if pid is not None]  # the worker (and its nanny, if any)
            since = time.time()
            record = {}

            def stop():
                wait_for_step(workers.client, 3, since)
                for pid in pids:  # SIGSTOP: the process lives, its sockets stay open, it answers nothing
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                record["stopped"] = time.time()
                workers.slow_steps(False)  # no step completes without the stopped member

            thread = threading.Thread(target=stop, daemon=True)
            thread.start()
            history = model.fit(train, epochs=1, verbose=0)
            thread.join(10)
            assert "stopped" in record
            (event,) = history.elastic.events
            assert event.lost == [victim] and len(event.members) == 2
            (stalled,) = [(t, m) for t, m in workers.client.get_events("daskdist") if m.get("action") == "stalled"]
            detection = stalled[0] - record["stopped"]
            print(f"stopped worker declared lost after {detection:.1f} s (silent {stalled[1]['silent']:.1f} s)")
            assert stalled[1]["worker"] == victim
            assert detection < 20  # 6 s deadline + a heartbeat; generous for a loaded machine
            assert victim not in scheduler_workers(workers.client)  # fenced out of the cluster
            assert sorted(history.elastic.ledger.positions(0, history.elastic.rows).tolist()) == list(range(240))
            assert strategy.num_replicas_in_sync == 2
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)


def _kill_worker_only(workers, address):
    """kill -9 the worker process but not its nanny: the nanny starts it again under the same name."""
    worker, _ = workers.pids(address)
    os.kill(worker, signal.SIGKILL)


def _wait_for_name(client, name, old_address, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for address, info in scheduler_workers(client).items():
            if info.get("name") == name and address != old_address:
                return address
        time.sleep(0.2)
    raise AssertionError(f"worker {name} did not come back")


@pytest.mark.slow
@pytest.mark.nanny_workers(3)
def test_a_failed_worker_restarted_by_its_nanny_is_not_admitted_during_its_cooldown(process_workers):
    workers = process_workers(3, nanny=True)  # its nanny restarts it
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)
    options = dd.ElasticOptions(min_replicas=2, admit_every="0.3s", cooldown="10min")
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        with strategy.scope():
            model = models.model()
        victim = strategy.extended.worker_addresses[1]
        name = scheduler_workers(workers.client)[victim]["name"]
        since = time.time()
        thread = threading.Thread(target=lambda: (wait_for_step(workers.client, 3, since),
                                                  _kill_worker_only(workers, victim)), daemon=True)
        thread.start()
        history = model.fit(train, epochs=1, verbose=0)
        thread.join(10)
        assert [e.action for e in history.elastic.events] == ["restored"]
        back = _wait_for_name(workers.client, name, victim)  # the same worker, restarted on a new port
        history = model.fit(train, epochs=2, verbose=0)  # free workers are looked for at every epoch and 0.3 s
        assert history.elastic.events == []  # it was not admitted: it failed less than the cooldown ago
        assert strategy.num_replicas_in_sync == 2 and back not in strategy.extended.worker_addresses
        assert back in scheduler_workers(workers.client)


@pytest.mark.slow
@pytest.mark.nanny_workers(3)
def test_a_worker_that_keeps_failing_is_named_in_the_error_once_max_failures_is_spent(process_workers):
    workers = process_workers(3, nanny=True)  # its nanny restarts it
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)
    options = dd.ElasticOptions(min_replicas=2, max_failures=1, admit_every="0.3s", cooldown="1s")
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        with strategy.scope():
            model = models.model()
        victim = strategy.extended.worker_addresses[2]
        name = scheduler_workers(workers.client)[victim]["name"]
        since = time.time()
        record = {}

        def fail_twice():
            wait_for_step(workers.client, 3, since)
            _kill_worker_only(workers, victim)
            back = _wait_for_name(workers.client, name, victim)  # restarted by its nanny
            deadline = time.monotonic() + 90
            while back not in strategy.extended.worker_addresses and time.monotonic() < deadline:
                time.sleep(0.05)  # its cooldown over, it is admitted again at a commit
            record["readmitted"] = back in strategy.extended.worker_addresses
            wait_for_step(workers.client, 0, time.time() + 0.5, epoch=None)  # it trains, then fails again
            _kill_worker_only(workers, back)

        thread = threading.Thread(target=fail_twice, daemon=True)
        thread.start()
        with pytest.raises(dd.ReplicaLostError, match="max_failures=1 is exhausted") as info:
            model.fit(train, epochs=40, verbose=0)
        thread.join(10)
        assert record["readmitted"]
        assert f"{name} (2 times)" in str(info.value)


@pytest.mark.slow
def test_a_worker_killed_while_it_copies_a_commit_is_recovered_with_the_uninterrupted_weights(
        process_workers, tmp_path):
    workers = process_workers(3)
    x, y = models.data(240)
    plain = Dataset.from_tensor_slices((x, y)).batch(24)
    train = plain.map(slow_batch)  # slowed until the kill lands
    weights = models.model().get_weights()
    expected = models.one_process_fit(weights, plain, epochs=1).weights  # the uninterrupted run
    marker = str(tmp_path / "copying")
    # every commit copies the state (most commits of a fit are replayed otherwise: no copy to be killed in)
    with (dask.config.set({"daskdist.elastic.replayed-commits": 1}),
          dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy):
        with strategy.scope():
            model = models.model(weights)
        victim = strategy.extended.worker_addresses[1]

        def slow_copies(marker=marker):  # on the victim: its 5th commit copy says so, then takes a while
            from daskdist.elastic import replica

            original, calls = replica._copy_state, [0]

            def copy(objects, *prepared):
                calls[0] += 1
                if calls[0] == 5:
                    open(marker, "w").close()
                    time.sleep(3)
                return original(objects, *prepared)

            replica._copy_state = copy

        workers.client.run(slow_copies, workers=[victim])

        def kill_mid_copy():
            deadline = time.monotonic() + 120
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
            workers.kill(victim)
            workers.slow_steps(False)

        thread = threading.Thread(target=kill_mid_copy, daemon=True)
        thread.start()
        history = model.fit(train, epochs=1, verbose=0)
        thread.join(10)
        assert os.path.exists(marker), "the victim never reached the copy"
        (event,) = history.elastic.events
        assert event.lost == [victim] and 0 < event.commit[2] < 10
        assert history.elastic.ledger.steps(0) == list(range(10))
        assert sorted(history.elastic.ledger.positions(0, history.elastic.rows).tolist()) == list(range(240))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # float32 summed in another order than one process


class _Array:
    """A resident with one array (a stand-in for a model's weights in a unit test of the commit copy)."""

    def __init__(self, value):
        self.value = value
        self.release = threading.Event()  # the copy waits for it: the test decides when it ends

    def snapshot(self):
        assert self.release.wait(60), "the copy was never released"
        return self.value.copy()

    def restore(self, state):
        self.value[...] = state


def test_a_commit_copies_in_the_background_and_holds_the_state_of_its_step():
    store = ResidentStore()
    weights = _Array(np.zeros(4))
    store.install("variable", "w", weights)
    ring = CommitRing()
    ring.add(Commit.copying((1, 0, 1), store, {}))  # returns while the copy waits: the step path goes on
    assert not ring.get((1, 0, 1)).copied
    weights.release.set()
    ring.settle()  # what the replica does before the next optimizer apply
    weights.value += 1  # the next apply
    ring.add(Commit.copying((1, 0, 2), store, {}))
    assert ring.get((1, 0, 1)).state[("variable", "w")].tolist() == [0.0] * 4
    assert ring.get((1, 0, 2)).state[("variable", "w")].tolist() == [1.0] * 4
    ring.add(Commit.copying((1, 0, 3), store, {}))
    assert list(ring.commits) == [(1, 0, 2), (1, 0, 3)]  # the two newest
    import pickle

    sent = pickle.loads(pickle.dumps(ring.get((1, 0, 3))))  # a commit sent to a newcomer waits for its copy
    assert sent.key == (1, 0, 3) and sent.state[("variable", "w")].tolist() == [1.0] * 4


def test_a_quarantine_keeps_a_failed_worker_out_for_its_cooldown_and_counts_by_name():
    now = [100.0]
    quarantine = Quarantine(clock=lambda: now[0])
    quarantine.remember({"tcp://a:1": {"name": "w1"}, "tcp://b:2": {"name": "w2"}})
    quarantine.failed(["tcp://a:1"])
    quarantine.remember({"tcp://a:9": {"name": "w1"}})  # restarted by its nanny on another port
    assert quarantine.cooling("tcp://a:9", 60) and not quarantine.cooling("tcp://b:2", 60)
    now[0] += 61
    assert not quarantine.cooling("tcp://a:9", 60)
    quarantine.failed(["tcp://a:9", "tcp://c:3"])
    assert quarantine.describe() == "w1 (2 times), tcp://c:3 (1 time)"


@pytest.mark.slow
def test_a_custom_loop_lets_a_retired_member_leave_at_its_commit_with_nothing_replayed(process_workers):
    workers = process_workers(3)
    values = np.arange(1, 121, dtype=np.float64)
    dataset = Dataset.from_tensor_slices(values).batch(12).map(slow_batch)  # 10 steps per epoch
    with dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            total = dd.Variable(np.zeros((), np.float64), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)

        def step(batch):
            (rows,) = batch
            total.assign_add(dd.get_replica_context().all_reduce("SUM", rows.sum()))

        @dd.elastic.run
        def train(state):
            while state.epoch < 2:
                for batch in state.batches(dataset):
                    if (state.epoch, state.batch) == (0, 4) and not retirer.is_alive() and not retired:
                        retirer.start()  # asked after 3 commits; the member leaves at a later one
                        retired.append(state.steps)  # 3 steps done: state.batch counts the one taken
                    strategy.run(step, args=(batch,))
                    state.steps += 1
                    state.commit()
                state.epoch += 1

        state = dd.elastic.State(strategy, epoch=0, steps=0)
        resets = []
        state.register_reset_callbacks([lambda: resets.append(strategy.num_replicas_in_sync)])
        victim = strategy.extended.worker_addresses[1]
        retired = []
        retirer = threading.Thread(  # slowed steps until the member has left
            target=lambda: (workers.client.retire_workers(workers=[victim], close_workers=True),
                            workers.slow_steps(False)), daemon=True)
        train(state)
        retirer.join(60)
        assert retired == [3] and not retirer.is_alive()
        (event,) = state.events
        assert event.action == "left" and event.left == [victim] and event.lost == [] and resets == [2]
        assert state.steps == 20 and state.epoch == 2
        assert total.read_value() == 2 * values.sum()  # every row added once per epoch: nothing replayed
        for epoch in (0, 1):
            assert sorted(state.ledger.positions(epoch, state._rows).tolist()) == list(range(120))


def _digest_of_state(service):
    """This replica's variables and models as one hash (what a commit would hold)."""
    return state_digest(service.objects.snapshot(STATE_KINDS))


@pytest.mark.slow
def test_a_custom_loop_admits_a_worker_started_mid_epoch_at_a_commit_and_every_replica_holds_one_state(
        process_workers):
    workers = process_workers(2)
    values = np.arange(1, 121, dtype=np.float64)
    dataset = Dataset.from_tensor_slices(values).batch(12).map(slow_batch)  # 10 steps per epoch
    options = dd.ElasticOptions(min_replicas=2, admit_every="0.1s")
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        with strategy.scope():
            total = dd.Variable(np.zeros((), np.float64), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)
        members_before = list(strategy.extended.worker_addresses)

        def step(batch):
            (rows,) = batch
            total.assign_add(dd.get_replica_context().all_reduce("SUM", rows.sum()))

        @dd.elastic.run
        def train(state):
            while state.epoch < 2:
                for batch in state.batches(dataset):
                    strategy.run(step, args=(batch,))
                    state.steps += 1
                    state.commit()
                    if state.epoch == 0 and state.batch == 3 and not state.started:
                        state.started = True  # a third worker starts mid-epoch; the loop goes on meanwhile
                        workers.add()
                        workers.client.wait_for_workers(3, timeout=120)
                state.epoch += 1

        state = dd.elastic.State(strategy, epoch=0, steps=0, started=False, total=total)
        resets = []

        def joined_at():
            resets.append((state.epoch, state.batch, strategy.num_replicas_in_sync))
            workers.slow_steps(False)  # it joined: the rest of the run needs no slowing

        state.register_reset_callbacks([joined_at])
        train(state)
        (event,) = state.events
        newcomer = [a for a in scheduler_workers(workers.client) if a not in members_before]
        assert event.action == "grew" and event.admitted == newcomer and event.lost == [] and event.left == []
        (joined,) = resets
        assert joined[0] == 0 and 3 <= joined[1] < 10 and joined[2] == 3  # at a commit inside epoch 0
        assert strategy.num_replicas_in_sync == 3 and state.steps == 20 and state.epoch == 2
        assert total.read_value() == 2 * values.sum()  # every row added once per epoch: nothing replayed
        for epoch in (0, 1):
            assert sorted(state.ledger.positions(epoch, state._rows).tolist()) == list(range(120))
        digests = strategy.extended.group.call(_digest_of_state)
        assert len(digests) == 3 and len(set(digests)) == 1


@pytest.mark.slow
def test_a_custom_loop_whose_variable_is_kept_outside_the_state_does_not_grow_and_says_why(process_workers,
                                                                                           caplog):
    workers = process_workers(3)
    values = np.arange(1, 49, dtype=np.float64)
    dataset = Dataset.from_tensor_slices(values).batch(12)
    options = dd.ElasticOptions(min_replicas=2, max_replicas=3, admit_every=0)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=workers.client, elastic=options) as strategy:
        with strategy.scope():
            total = dd.Variable(np.zeros((), np.float64), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)

        def step(batch):
            total.assign_add(dd.get_replica_context().all_reduce("SUM", batch.sum()))

        @dd.elastic.run
        def train(state):
            for batch in state.batches(dataset):
                strategy.run(step, args=(batch,))
                state.commit()

        state = dd.elastic.State(strategy)
        with caplog.at_level("WARNING", logger="daskdist.elastic.state"):
            train(state)
        assert state.events == [] and strategy.num_replicas_in_sync == 2
        assert total.read_value() == values.sum()
        assert any("not admitting free workers" in r.getMessage() and "variable" in r.getMessage()
                   for r in caplog.records)


def test_the_heartbeat_watch_names_silent_members_of_elastic_groups_once_the_scheduler_kept_time():
    from types import SimpleNamespace

    from daskdist.group.departures import Departures
    from daskdist.group.group_state import GroupState

    now = 1000.0
    workers = {a: SimpleNamespace(last_seen=now - silent) for a, silent in (("a", 1), ("b", 7), ("c", 30))}
    elastic = GroupState("g1", ["a", "b"], None, status="running", policy="elastic", heartbeat_timeout=6.0)
    fixed = GroupState("g2", ["c"], None, status="running", policy="fixed", heartbeat_timeout=6.0)
    plugin = SimpleNamespace(groups={"g1": elastic, "g2": fixed}, running_scheduler=SimpleNamespace(workers=workers))
    watch = Departures(plugin)  # type: ignore[arg-type]
    watch.responsive_since = now - 100
    assert [(g.group_id, w) for g, w, _ in watch.stalled(now)] == [("g1", "b")]  # fixed groups: Dask's worker-ttl
    watch.responsive_since = now - 3  # the scheduler was blocked 3 s ago: old heartbeats prove nothing yet
    assert watch.stalled(now) == []
    watch.responsive_since = now - 100
    elastic.heartbeat_timeout = 8.0
    assert watch.stalled(now) == []
    elastic.heartbeat_timeout = 3.0  # never below ten of Dask's heartbeats (5 s with a few workers)
    assert [w for _, w, _ in watch.stalled(now)] == ["b"]
    elastic.heartbeat_timeout = 0.0  # off
    assert watch.stalled(now) == []


@pytest.mark.slow
def test_a_member_retired_between_two_fits_leaves_at_once_and_is_no_failure(process_workers):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24)
    options = dd.ElasticOptions(min_replicas=2, max_failures=0)  # a single loss would end the next fit
    with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
        with strategy.scope():
            model = models.model()
        model.fit(train, epochs=1, verbose=0)
        victim = strategy.extended.worker_addresses[2]
        start = time.monotonic()
        workers.client.retire_workers(workers=[victim], close_workers=True)  # the group runs nothing meanwhile
        assert time.monotonic() - start < 30  # not the 60 s leave-timeout: the scheduler re-formed the idle group
        assert victim not in scheduler_workers(workers.client)
        assert any(m.get("action") == "left" and list(m.get("workers", ())) == [victim]
                   for _, m in workers.client.get_events("daskdist"))
        history = model.fit(train, epochs=1, verbose=0)  # the group moved on while idle: nothing to restore
        assert history.elastic.events == []
        assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
        assert int(model._optimizer_state()["iterations"]) == 20  # nothing replayed, nothing lost


def test_the_cooldown_is_a_checked_duration():
    assert dd.ElasticOptions().cooldown_seconds == 60
    assert dd.ElasticOptions(cooldown="10min").cooldown_seconds == 600
    assert dd.ElasticOptions(cooldown=0).cooldown_seconds == 0
    with pytest.raises(ValueError, match="cooldown"):
        dd.ElasticOptions(cooldown="soon")
    with pytest.raises(ValueError, match="cooldown"):
        dd.ElasticOptions(cooldown=-1)
