"""Elastic MultiWorkerMirroredStrategy on real processes: a worker and its nanny killed at each phase of a step.

A test-only fault point (``daskdist.testing.pause-at``, ``daskdist/fault_points.py``) makes one replica stop
at one phase of one step and say so in a file; the test then kills -9 that worker and its nanny, so the
kill lands exactly there. The gradients go through the ring all-reduce (``implementation="models.RING"``), whose
two halves are phases. Each time ``fit`` finishes on the two survivors, every row of each epoch is
committed once, and the weights equal those of an uninterrupted run within float tolerance.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import config, fault_points, keras
from daskdist.cluster.identity import scheduler_workers
from tests.support import models
from tests.support.killers import Killer

Dataset = dd.data.Dataset

pytestmark = pytest.mark.timeout(240)

VICTIM_RANK, PAUSE_STEP = 1, 4  # rank 1 of 3, at the fifth step of the first epoch


@pytest.fixture(scope="module")
def uninterrupted(threaded_client):
    """The uninterrupted run: MWMS over 3 replicas, the same data, model and initial weights."""
    weights = models.model().get_weights()
    with dd.MultiWorkerMirroredStrategy(communication_options=models.RING, client=threaded_client) as strategy:
        with strategy.scope():
            model = models.model(weights)
        history = model.fit(models.train_set(), epochs=2, verbose=0)
        return weights, model.get_weights(), history.history


def test_pause_points_are_parsed_and_checked():
    assert fault_points.PausePoint.parse("reduce-scatter:4:1") == fault_points.PausePoint("reduce-scatter", 4, 1)
    assert fault_points.PausePoint.parse("restore:*:0") == fault_points.PausePoint("restore", None, 0)
    assert fault_points.PausePoint("restore", None, 0).matches("restore", 7)
    assert not fault_points.PausePoint("apply", 3, 0).matches("apply", 4)
    for bad in ("reduce:4:1", "apply:4", "apply:-1:0", "apply:x:0", "apply:1:2:3", "apply:4:*"):
        with pytest.raises(ValueError, match="pause-at must be '<phase>:<step>:<rank>'"):
            fault_points.PausePoint.parse(bad)
    assert config.get("testing.pause-at") is None  # off by default


def test_a_pause_point_fires_once_on_its_rank_and_step_and_writes_who_paused(tmp_path):
    marker = tmp_path / "paused.json"
    steps = iter(range(10))
    settings = {"daskdist.testing.pause-at": "forward:2:1", "daskdist.testing.pause-file": str(marker),
                "daskdist.testing.pause-seconds": "0.2s"}
    with dask.config.set(settings):
        assert fault_points.arm(0, lambda: 0) is not None  # another rank: armed, but never pauses
        fault_points.begin_step(2)
        fault_points.reached("forward")
        assert not marker.exists()
        before_batch = fault_points.arm(1, lambda: next(steps))
        paused_at, records = [], []
        for _ in range(4):
            before_batch()  # steps 0, 1, 2, 3
            fault_points.reached("forward")
            fault_points.reached("apply")
            if marker.exists():  # a pause writes who paused (whole, or not at all), then sleeps
                paused_at.append(fault_points._local.step)
                records.append(json.loads(marker.read_text()))
                marker.unlink()
        assert paused_at == [2]
        (record,) = records
        assert record["pid"] == os.getpid() and record["ppid"] == os.getppid()
        assert (record["phase"], record["step"], record["rank"]) == ("forward", 2, 1)
        fault_points.arm(1, lambda: 2)  # armed again (a replayed step after a loss): its lock says it fired
        fault_points.begin_step(2)
        fault_points.reached("forward")
        assert not marker.exists()  # no second pause
    handed = tmp_path / "handed.json"  # a point handed to another thread (a commit's copy) pauses there
    with dask.config.set({**settings, "daskdist.testing.pause-at": "commit:3:0",
                          "daskdist.testing.pause-file": str(handed)}):
        fault_points.arm(0, lambda: 0)
        fault_points.begin_step(3)
        pause = fault_points.bound("commit")
        assert pause is not None and fault_points.bound("commit") is None  # handed over once
        helper = threading.Thread(target=pause)
        helper.start()
        helper.join(5)
        assert json.loads(handed.read_text())["phase"] == "commit"
    with dask.config.set({"daskdist.testing.pause-at": "forward:2:1"}), \
            pytest.raises(ValueError, match="needs daskdist.testing.pause-file"):
        fault_points.arm(1, lambda: 0)
    assert fault_points.arm(1, lambda: 0) is None  # unset: nothing armed


def test_after_a_re_formation_hosts_left_are_renumbered_and_newcomers_join_their_host():
    from daskdist.cluster_resolver.selection import HostGroup
    from daskdist.strategy.extended.multi_worker_mirrored import renumber_hosts

    a = [f"tcp://10.0.0.{h}:{p}" for h in (1, 2, 3) for p in (1, 2)]  # hosts .1, .2, .3 with two workers each
    hosts = [HostGroup("h1", (a[0], a[1])), HostGroup("h2", (a[2], a[3])), HostGroup("h3", (a[4], a[5]))]
    # host h2 lost entirely: h3 becomes task 1
    groups, tasks = renumber_hosts(hosts, [a[0], a[1], a[4], a[5]])
    assert [g.entry for g in groups] == ["h1", "h3"] and tasks == [0, 0, 1, 1]
    # rank 0 lost (the oldest survivor of h1 leads): h1 keeps task 0 with one worker
    groups, tasks = renumber_hosts(hosts, [a[1], a[2], a[3]])
    assert groups == [HostGroup("h1", (a[1],)), HostGroup("h2", (a[2], a[3]))] and tasks == [0, 1, 1]
    # newcomers: one on h2's machine joins h2, one on a new machine forms host 2
    newcomer, stranger = "tcp://10.0.0.2:9", "tcp://10.0.0.9:1"
    groups, tasks = renumber_hosts(hosts[:2], [a[0], a[2], a[3], newcomer, stranger])
    assert groups[1] == HostGroup("h2", (a[2], a[3], newcomer)) and groups[2] == HostGroup("10.0.0.9", (stranger,))
    assert tasks == [0, 1, 1, 1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("phase", fault_points.STEP_PHASES)
def test_kill_9_of_one_of_3_workers_at_each_phase_of_a_step_fit_finishes_with_the_uninterrupted_weights(
        phase, uninterrupted, process_workers, tmp_path):
    weights, expected, reference = uninterrupted
    workers = process_workers(3)
    marker = tmp_path / "paused.json"
    settings = {"daskdist.testing.pause-at": f"{phase}:{PAUSE_STEP}:{VICTIM_RANK}",
                "daskdist.testing.pause-file": str(marker),
                "daskdist.elastic.replayed-commits": 1}  # every commit copied: the "commit" phase is the copy
    with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(
            communication_options=models.RING, client=workers.client,
            elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        assert strategy.num_replicas_in_sync == 3 and strategy.extended.group.spec.policy == "elastic"
        with strategy.scope():
            model = models.model(weights)
        victim = strategy.extended.worker_addresses[VICTIM_RANK]
        killer = Killer(marker, workers=workers)
        history = model.fit(models.train_set(), epochs=2, verbose=0)
        record = killer.join()
        assert (record["phase"], record["step"], record["rank"], record["address"]) == (
            phase, PAUSE_STEP, VICTIM_RANK, victim)
        assert strategy.num_replicas_in_sync == 2 and victim not in strategy.extended.worker_addresses
        (event,) = history.elastic.events
        assert event.lost == [victim] and event.action == "restored" and len(event.members) == 2
        _, epoch, step = event.commit
        # back to the newest commit a step's all-reduce carried the totals of: a commit enters the ring with the
        # next step's exchange, so a death before step PAUSE_STEP's exchange ended leaves the commit before it
        # (PAUSE_STEP - 1), a death in its apply the commit it carried (PAUSE_STEP); a death in the thread that
        # copies the commit after it (PAUSE_STEP + 1) leaves that one if the next step's exchange carried it
        # before the kill landed (the step path goes on while the copy is paused), else the one before
        want = {"apply": (PAUSE_STEP,), "commit": (PAUSE_STEP, PAUSE_STEP + 1)}.get(phase, (PAUSE_STEP - 1,))
        assert epoch == 0 and step in want
        restored = [t for t, m in workers.client.get_events("daskdist-elastic") if m.get("action") == "restored"]
        assert len(restored) == 1 and restored[0] - record["killed"] < 15  # detected and re-formed in seconds
        for e in (0, 1):  # every row of each epoch in exactly one committed update
            assert history.elastic.ledger.steps(e) == list(range(10))
            assert sorted(history.elastic.ledger.positions(e, history.elastic.rows).tolist()) == list(range(240))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert history.history["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert history.history["accuracy"] == pytest.approx(reference["accuracy"], rel=1e-5)
        assert int(model._optimizer_state()["iterations"]) == 20  # each step applied once in the state kept
        # the survivors' resolvers name the two members left (one host here: task 0)
        seen = strategy.extended.group.call(models.resolver_view)
        assert [s[0] for s in seen] == [("worker", 0)] * 2
        assert all(victim not in s[1] and len(s[1]) == 2 for s in seen)


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    return train_test_split(images, digits.target.astype(np.int64), test_size=0.2, random_state=0)


def _cnn(weights=None):
    model = keras.Sequential([
        keras.layers.Conv2D(16, 3, activation="relu", input_shape=(8, 8, 1)),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(0.003), metrics=["accuracy"])
    model.build((8, 8, 1))
    if weights is not None:
        model.set_weights(weights)
    return model


def _seeded_weights(model, seed=0):
    """Glorot-uniform kernels and zero biases from a seeded generator: the same start in every run."""
    rng = np.random.default_rng(seed)
    weights = []
    for w in model.get_weights():
        if w.ndim == 1:
            weights.append(np.zeros_like(w))
        else:
            fan_in, fan_out = int(np.prod(w.shape[:-1])), int(w.shape[-1])
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            weights.append(rng.uniform(-limit, limit, w.shape).astype(w.dtype))
    return weights


@pytest.mark.slow
def test_a_kill_inside_the_all_reduce_leaves_the_digits_test_accuracy_within_half_a_point(process_workers, tmp_path):
    x_train, x_test, y_train, y_test = _digits()
    train = Dataset.from_tensor_slices((x_train, y_train)).batch(48)  # 30 steps per epoch, the last one partial
    workers = process_workers(3)
    weights = _seeded_weights(_cnn())
    accuracy = {}
    for interrupted in (False, True):
        marker = tmp_path / f"paused-{interrupted}.json"
        settings = {"daskdist.testing.pause-at": f"all-gather:40:{VICTIM_RANK}" if interrupted else None,
                    "daskdist.testing.pause-file": str(marker)}
        with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(
                communication_options=models.RING, client=workers.client,
                elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
            with strategy.scope():
                model = _cnn(weights)
            killer = Killer(marker, workers=workers) if interrupted else None
            history = model.fit(train, epochs=5, verbose=0)
            if killer is not None:
                assert killer.join()["phase"] == "all-gather"
                (event,) = history.elastic.events
                # step 40 is the eleventh of the second epoch: back to the commit before it whose totals a step carried
                assert event.commit[1:] == (1, 9)
            accuracy[interrupted] = model.evaluate(Dataset.from_tensor_slices((x_test, y_test)).batch(90),
                                                   verbose=0, return_dict=True)["accuracy"]
    assert accuracy[False] > 0.9, accuracy  # it learned
    assert abs(accuracy[True] - accuracy[False]) <= 0.005, accuracy


@pytest.mark.slow
def test_an_elastic_custom_loop_under_mwms_survives_a_killed_worker_and_counts_every_row_once(process_workers):
    workers = process_workers(3)
    values = np.arange(1, 121, dtype=np.float64)
    dataset = Dataset.from_tensor_slices(values).batch(12)  # 10 steps per epoch
    with dd.MultiWorkerMirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            total = dd.Variable(np.zeros((), np.float64), aggregation=dd.VariableAggregation.ONLY_FIRST_REPLICA)
        victim = strategy.extended.worker_addresses[2]
        killed = []

        def step(rows):
            total.assign_add(dd.get_replica_context().all_reduce("SUM", rows.sum()))

        @dd.elastic.run
        def train(state):
            while state.epoch < 2:
                for batch in state.batches(dataset):
                    if (state.epoch, state.batch) == (0, 5) and not killed:
                        workers.kill(victim)  # between two steps, after 4 commits: the next run fails
                        killed.append(state.steps)
                    state.steps += 1
                    strategy.run(step, args=(batch,))
                    state.commit()
                state.epoch += 1

        state = dd.elastic.State(strategy, epoch=0, steps=0)
        train(state)
        (event,) = state.events
        assert event.lost == [victim] and strategy.num_replicas_in_sync == 2
        assert killed == [4] and state.steps == 20  # the failed step's count went back with the commit
        assert total.read_value() == 2 * values.sum()  # each row added once per epoch, none replayed or skipped
        for epoch in (0, 1):
            assert sorted(state.ledger.positions(epoch, state._rows).tolist()) == list(range(120))
        assert [s[0] for s in strategy.extended.group.call(models.resolver_view)] == [("worker", 0)] * 2


@pytest.mark.slow
def test_a_free_worker_joins_an_elastic_mwms_at_the_next_epoch_with_a_resolver_of_the_grown_group(process_workers):
    workers = process_workers(3)
    chosen = sorted(scheduler_workers(workers.client))[:2]
    resolver = dd.cluster_resolver.DaskClusterResolver(workers=chosen)
    weights = models.model().get_weights()
    options = dd.ElasticOptions(min_replicas=2, max_replicas=3)
    with dd.MultiWorkerMirroredStrategy(resolver, client=workers.client, elastic=options) as strategy:
        assert list(strategy.extended.worker_addresses) == chosen
        (free,) = set(scheduler_workers(workers.client)) - set(chosen)
        with strategy.scope():
            model = models.model(weights)
        history = model.fit(models.train_set(), epochs=2, verbose=0)
        (event,) = history.elastic.events
        assert event.action == "grew" and event.admitted == [free]
        assert strategy.num_replicas_in_sync == 3 and strategy.extended.num_hosts == 1
        assert strategy.cluster_resolver is resolver  # the user's resolver stays the strategy's (TF)
        seen = strategy.extended.group.call(models.resolver_view)  # the newcomer too has a resolver, of all three
        assert [s[0] for s in seen] == [("worker", 0)] * 3
        assert all(sorted(s[1]) == sorted([*chosen, free]) for s in seen)
        assert sorted(history.elastic.ledger.positions(1, history.elastic.rows).tolist()) == list(range(240))


# -- separate hosts (network namespaces: tests/netns.py) -------------------------------------------------------

netns = pytest.mark.netns


@pytest.fixture
def fresh_hosts():
    """Two namespace hosts h1, h2 with two Dask workers each (no nannies), made for one test that breaks them."""
    from distributed import Client

    from tests.netns import start_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    hosts = start_hosts(2, 2, rate="10gbit")
    previous = signal.signal(signal.SIGTERM, lambda *_: (hosts.close(), os._exit(143)))
    try:
        with Client(hosts.scheduler_address, set_as_default=False) as client:
            client.wait_for_workers(4, timeout=60)
            yield hosts, client
    finally:
        signal.signal(signal.SIGTERM, previous)
        hosts.close()


def _wide_set():
    x, y = models.data(320, features=8, seed=1)
    return Dataset.from_tensor_slices((x, y)).batch(32)  # 10 steps per epoch


def _wide_model(weights=None):
    model = keras.Sequential([keras.layers.Dense(16, activation="relu", input_shape=(8,)), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    model.build((8,))
    if weights is not None:
        model.set_weights(weights)
    return model


def _uninterrupted_on(client, weights):
    with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        assert strategy.num_replicas_in_sync == 4 and strategy.extended.num_hosts == 2
        with strategy.scope():
            model = _wide_model(weights)
        history = model.fit(_wide_set(), epochs=2, verbose=0)
        return model.get_weights(), history.history


def _host_workers(client, host) -> list[str]:
    return sorted(a for a in scheduler_workers(client) if f"//{host.address}:" in a)


def _check_finished_on_h1(strategy, history, hosts, client, expected, reference):
    h1 = hosts.hosts[0]
    assert strategy.num_replicas_in_sync == 2 and strategy.extended.num_hosts == 1
    assert all(f"//{h1.address}:" in a for a in strategy.extended.worker_addresses)
    for e in (0, 1):
        assert sorted(history.elastic.ledger.positions(e, history.elastic.rows).tolist()) == list(range(320))
    for got, want in zip(history.model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert history.history["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    # the survivors' TF view: one host left, task 0, the spec naming only h1
    seen = strategy.extended.group.call(models.resolver_view)
    assert [s[0] for s in seen] == [("worker", 0)] * 2
    assert strategy.cluster_resolver.cluster_spec().as_dict() == {"worker": [h1.address]}


@netns
@pytest.mark.slow
def test_a_whole_host_lost_mid_epoch_mwms_training_finishes_on_the_other_host(fresh_hosts, tmp_path):
    hosts, client = fresh_hosts
    weights = _wide_model().get_weights()
    expected, reference = _uninterrupted_on(client, weights)
    h2 = hosts.hosts[1]
    lost = _host_workers(client, h2)
    marker = tmp_path / "paused.json"
    settings = {"daskdist.testing.pause-at": f"forward:{PAUSE_STEP}:2",  # h2's first replica, mid step 4
                "daskdist.testing.pause-file": str(marker)}
    with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(
            client=client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        assert strategy.extended.num_hosts == 2
        with strategy.scope():
            model = _wide_model(weights)
        record: dict = {}

        def lose_h2():
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            record.update(json.loads(marker.read_text()))
            for worker in h2.workers:  # every process of the host (its workers have no nanny)
                os.kill(worker.pid, signal.SIGKILL)
            record["killed"] = time.time()

        thread = threading.Thread(target=lose_h2, daemon=True)
        thread.start()
        history = model.fit(_wide_set(), epochs=2, verbose=0)
        thread.join(5)
        assert record.get("host") == "h2" and "killed" in record
        assert sorted(a for event in history.elastic.events for a in event.lost) == lost
        restored = [t for t, m in client.get_events("daskdist-elastic") if m.get("action") == "restored"]
        assert restored and restored[-1] - record["killed"] < 15
        _check_finished_on_h1(strategy, history, hosts, client, expected, reference)


@netns
@pytest.mark.slow
def test_h2s_leader_killed_inside_the_cross_host_ring_training_finishes_on_three_replicas_over_two_hosts(
        fresh_hosts, tmp_path):
    """Every pack goes through the hierarchical all-reduce (no one-hop size), whose leaders' ring crosses hosts."""
    hosts, client = fresh_hosts
    weights = _wide_model().get_weights()
    with dask.config.set({"daskdist.collective.small-message-bytes": 0}):
        expected, reference = _uninterrupted_on(client, weights)
    h1, h2 = hosts.hosts
    marker = tmp_path / "paused.json"
    settings = {"daskdist.collective.small-message-bytes": 0,
                "daskdist.testing.pause-at": f"reduce-scatter:{PAUSE_STEP}:2",  # h2's leader, in the hosts' ring
                "daskdist.testing.pause-file": str(marker)}
    with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(
            client=client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            model = _wide_model(weights)
        victim = strategy.extended.worker_addresses[2]
        killer = Killer(marker, nanny=False)
        history = model.fit(_wide_set(), epochs=2, verbose=0)
        record = killer.join()
        assert (record["host"], record["address"], record["phase"]) == ("h2", victim, "reduce-scatter")
        (event,) = history.elastic.events
        assert event.lost == [victim] and event.commit[1:] == (0, PAUSE_STEP - 1)  # the commit a step carried last
        assert strategy.num_replicas_in_sync == 3 and strategy.extended.num_hosts == 2
        # h2's other worker is its host's only replica now: task 1, the spec still naming both hosts
        seen = strategy.extended.group.call(models.resolver_view)
        assert [s[0] for s in seen] == [("worker", 0), ("worker", 0), ("worker", 1)]
        assert strategy.cluster_resolver.cluster_spec().as_dict() == {"worker": [h1.address, h2.address]}
        for e in (0, 1):
            assert sorted(history.elastic.ledger.positions(e, history.elastic.rows).tolist()) == list(range(320))
        for got, want in zip(model.get_weights(), expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert history.history["loss"] == pytest.approx(reference["loss"], rel=1e-5)


@netns
@pytest.mark.slow
def test_a_host_cut_off_mid_epoch_is_detected_within_10_seconds_and_training_finishes_on_the_rest(
        fresh_hosts, tmp_path):
    hosts, client = fresh_hosts
    weights = _wide_model().get_weights()
    expected, reference = _uninterrupted_on(client, weights)
    h2 = hosts.hosts[1]
    lost = _host_workers(client, h2)
    marker = tmp_path / "paused.json"
    settings = {"daskdist.testing.pause-at": f"forward:{PAUSE_STEP}:2", "daskdist.testing.pause-file": str(marker),
                "daskdist.testing.pause-seconds": "3s"}  # then it runs on, into a link that is down
    try:
        with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(
                client=client, elastic=dd.ElasticOptions(min_replicas=2, generation_timeout="90s")) as strategy:
            with strategy.scope():
                model = _wide_model(weights)
            record: dict = {}

            def cut_h2():
                deadline = time.monotonic() + 120
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                hosts.link_down(1)  # no FIN, no RST: h2's packets just vanish
                record["cut"] = time.time()

            thread = threading.Thread(target=cut_h2, daemon=True)
            thread.start()
            history = model.fit(_wide_set(), epochs=2, verbose=0)
            thread.join(5)
            assert "cut" in record
            assert sorted(a for event in history.elastic.events for a in event.lost) == lost
            # detected within 10 s: the scheduler moved the group to a generation without h2's workers ...
            formed = [t for t, m in client.get_events("daskdist") if m.get("action") == "generation"
                      and t > record["cut"] and set(m["workers"]).isdisjoint(lost)]
            assert formed and formed[0] - record["cut"] < 10, [t - record["cut"] for t in formed]
            # ... and training went on from the survivors' commit soon after
            restored = [t for t, m in client.get_events("daskdist-elastic") if m.get("action") == "restored"]
            assert restored and restored[-1] - record["cut"] < 15, restored[-1] - record["cut"]
            _check_finished_on_h1(strategy, history, hosts, client, expected, reference)
    finally:
        hosts.link_up(1)
