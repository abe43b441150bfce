"""The harder losses of an elastic group, on real ``dask worker`` processes (each with its nanny).

A second worker killed while the survivors of a first loss are restoring their commit (the ``restore``
fault point, ``daskdist/fault_points.py``, lands the kill there); under MultiWorkerMirroredStrategy, rank 0
killed (it holds the weights the client reads and the epoch's metric totals) and a loss that leaves the group
below ``min_replicas`` (a wait, then a clear ``ReplicaLostError``). Kills land through the fault points'
files (``Killer``) or on replica 0's progress events (``_kill_at_step``), as in the other elastic tests.
"""

from __future__ import annotations

import json
import os
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import fault_points
from daskdist.cluster.identity import scheduler_workers
from tests.support import models
from tests.support.killers import Killer, kill_at_step
from tests.support.models import slow_batch

Dataset = dd.data.Dataset

pytestmark = pytest.mark.timeout(240)


def _slow_set():
    x, y = models.data(240)
    return Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)  # 10 steps of about 0.12 s


def _check_exact(history, model, expected, reference, epochs=2):
    """Every row of each epoch in exactly one committed update; the uninterrupted run's weights and logs."""
    for e in range(epochs):
        assert history.elastic.ledger.steps(e) == list(range(10))
        assert sorted(history.elastic.ledger.positions(e, history.elastic.rows).tolist()) == list(range(240))
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert history.history["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert history.history["accuracy"] == pytest.approx(reference["accuracy"], rel=1e-5)
    assert int(model._optimizer_state()["iterations"]) == 10 * epochs  # each step applied once in the state kept


@pytest.fixture(scope="module")
def uninterrupted_mirrored(threaded_client):
    """MirroredStrategy over 3 replicas, no loss: the initial weights, the final ones, the logs."""
    weights = models.model().get_weights()
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            model = models.model(weights)
        history = model.fit(models.train_set(), epochs=2, verbose=0)  # the same batches, not slowed
        return weights, model.get_weights(), history.history


@pytest.fixture(scope="module")
def uninterrupted_mwms(threaded_client):
    """MultiWorkerMirroredStrategy over 3 replicas through the ring all-reduce, no loss."""
    weights = models.model().get_weights()
    with dd.MultiWorkerMirroredStrategy(communication_options=models.RING, client=threaded_client) as strategy:
        with strategy.scope():
            model = models.model(weights)
        history = model.fit(models.train_set(), epochs=2, verbose=0)
        return weights, model.get_weights(), history.history


def test_the_restore_point_fires_once_on_the_new_generations_rank_at_the_commits_step(tmp_path):
    marker = tmp_path / "paused.json"
    settings = {"daskdist.testing.pause-at": "restore:4:1", "daskdist.testing.pause-file": str(marker),
                "daskdist.testing.pause-seconds": "0.2s"}
    with dask.config.set(settings):
        assert fault_points.arm(1, lambda: 4) is not None  # a training command arms it (ARMED); no step pauses
        fault_points.begin_step(4)
        for phase in fault_points.STEP_PHASES:
            fault_points.reached(phase)
        for rank, step in ((0, 4), (1, 3)):  # another rank, another commit: no pause
            fault_points.restoring(rank, step)
        assert not marker.exists()
        fault_points.restoring(1, 4)
        record = json.loads(marker.read_text())  # the pause wrote who paused
        assert (record["phase"], record["step"], record["rank"], record["pid"]) == ("restore", 4, 1, os.getpid())
        marker.unlink()
        fault_points.restoring(1, 4)  # fired once: a later restore runs on, with no second pause
        assert not marker.exists()
    anywhere = tmp_path / "any.json"
    with dask.config.set({**settings, "daskdist.testing.pause-at": "restore:*:0",
                          "daskdist.testing.pause-file": str(anywhere)}):
        fault_points.restoring(0, 7)  # "*": whatever commit the survivors agreed on
        assert json.loads(anywhere.read_text())["step"] == 7


@pytest.mark.slow
def test_a_second_worker_killed_while_the_survivors_restore_the_commit_fit_finishes_on_the_last_two(
        uninterrupted_mirrored, process_workers, tmp_path):  # noqa: F811
    weights, expected, reference = uninterrupted_mirrored
    workers = process_workers(4)
    marker = tmp_path / "paused.json"
    # rank 1 of the generation after the first loss pauses inside its restore, whatever the commit: killed there
    settings = {"daskdist.testing.pause-at": "restore:*:1", "daskdist.testing.pause-file": str(marker)}
    with dask.config.set(settings), dd.MirroredStrategy(
            client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        assert strategy.num_replicas_in_sync == 4
        with strategy.scope():
            model = models.model(weights)
        members = list(strategy.extended.worker_addresses)
        first = members[1]
        killer = Killer(marker, workers=workers)
        thread, killed_first = kill_at_step(workers, first, step=4)  # mid-epoch, on replica 0's progress
        start = time.monotonic()
        history = model.fit(_slow_set(), epochs=2, verbose=0)
        thread.join(5)
        assert "killed" in killed_first, "the first worker was never killed"
        record = killer.join()
        second = record["address"]
        assert record["phase"] == "restore" and second in members[2:]  # a survivor of the first loss, not rank 0
        assert strategy.num_replicas_in_sync == 2
        assert sorted(strategy.extended.worker_addresses) == sorted(a for a in members if a not in (first, second))
        (event,) = history.elastic.events  # one recovery, started again on the members left by the second loss
        assert sorted(event.lost) == sorted([first, second]) and event.action == "restored"
        assert len(event.members) == 2 and event.admitted == []
        _, epoch, step = event.commit
        assert epoch == 0 and 0 < step < 10 and record["step"] == step  # the second loss hit the restore of it
        assert history.elastic.failures == 2
        restored = [m for _, m in workers.client.get_events("daskdist-elastic") if m.get("action") == "restored"]
        assert len(restored) == 1 and sorted(restored[0]["lost"]) == sorted([first, second])
        _check_exact(history, model, expected, reference)
        assert time.monotonic() - start < 120


@pytest.mark.slow
def test_rank_0_killed_mid_epoch_under_mwms_its_weights_and_metrics_come_back_from_the_commit(
        uninterrupted_mwms, process_workers, tmp_path):  # noqa: F811
    weights, expected, reference = uninterrupted_mwms
    workers = process_workers(3)
    marker = tmp_path / "paused.json"
    settings = {"daskdist.testing.pause-at": "forward:4:0", "daskdist.testing.pause-file": str(marker)}
    with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(
            communication_options=models.RING, client=workers.client,
            elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        with strategy.scope():
            model = models.model(weights)
        members = list(strategy.extended.worker_addresses)
        victim = members[0]  # the replica the client reads the weights from, and that sums the epoch's metrics
        killer = Killer(marker, workers=workers)
        history = model.fit(models.train_set(), epochs=2, verbose=0)
        record = killer.join()
        assert (record["phase"], record["step"], record["rank"], record["address"]) == ("forward", 4, 0, victim)
        assert list(strategy.extended.worker_addresses) == members[1:]  # the oldest survivor is rank 0 now
        (event,) = history.elastic.events
        # the commit after step 4 enters the ring once the next step's all-reduce carried its totals: killed in
        # that step's forward, every survivor goes back to the commit after step 3
        assert event.lost == [victim] and event.commit[1:] == (0, 3) and event.members == members[1:]
        assert history.elastic.failures == 1
        _check_exact(history, model, expected, reference)  # the metric totals too: rank 0's, from the commit
        seen = strategy.extended.group.call(models.resolver_view)
        assert [s[0] for s in seen] == [("worker", 0)] * 2
        assert all(victim not in s[1] and len(s[1]) == 2 for s in seen)


@pytest.mark.slow
def test_under_mwms_a_loss_below_min_replicas_waits_then_raises_naming_the_lost_worker_on_every_call(
        process_workers, tmp_path):  # noqa: F811
    workers = process_workers(2)
    marker = tmp_path / "paused.json"
    settings = {"daskdist.testing.pause-at": "forward:4:1", "daskdist.testing.pause-file": str(marker)}
    options = dd.ElasticOptions(min_replicas=2, wait_timeout="1s")  # nothing comes: a short wait is enough
    start = time.monotonic()
    with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(client=workers.client,
                                                                   elastic=options) as strategy:
        with strategy.scope():
            model = models.model()
        victim = strategy.extended.worker_addresses[1]
        killer = Killer(marker, workers=workers)
        with pytest.raises(dd.ReplicaLostError, match="min_replicas=2") as info:
            model.fit(models.train_set(), epochs=2, verbose=0)
        raised = time.time()
        record = killer.join()
        assert record["address"] == victim
        assert info.value.worker == victim and victim in str(info.value) and "wait_timeout (1 s)" in str(info.value)
        assert 1 <= raised - record["killed"] < 30, raised - record["killed"]  # it waited, then gave up
        assert strategy.num_replicas_in_sync == 1 and victim not in strategy.extended.worker_addresses
        # the run is over, not wedged: the next fit waits for a worker again, then raises the same clear error
        again = time.monotonic()
        with pytest.raises(dd.ReplicaLostError, match="min_replicas=2") as info:
            model.fit(models.train_set(), epochs=1, verbose=0)
        assert info.value.worker == victim and 1 <= time.monotonic() - again < 30
        assert strategy.num_replicas_in_sync == 1  # it never trained below min_replicas
        # a worker that comes in time is admitted by the next fit, gets the survivor's commit, and trains
        workers.add()
        workers.client.wait_for_workers(2, timeout=60)  # registered: the fit's wait is not a race with its start
        history = model.fit(models.train_set(), epochs=1, verbose=0)
        (event,) = history.elastic.events
        assert event.action == "grew" and len(event.admitted) == 1 and victim not in event.admitted
        assert strategy.num_replicas_in_sync == 2
        assert sorted(history.elastic.ledger.positions(0, history.elastic.rows).tolist()) == list(range(240))
        digests = strategy.extended.group.call(_weights_digest)
        assert len(digests) == 2 and digests[0] == digests[1]  # the newcomer trained in step with the survivor
    assert time.monotonic() - start < 150  # the strategy closed: nothing hung


def _weights_digest(service):
    from daskdist.elastic.replica import STATE_KINDS, state_digest

    return state_digest(service.objects.snapshot(STATE_KINDS))


def test_a_strategy_started_below_min_replicas_admits_a_free_worker_before_its_first_step(
        uninterrupted_mwms, threaded_client):
    weights, expected, reference = uninterrupted_mwms
    (chosen, *free) = sorted(scheduler_workers(threaded_client))
    resolver = dd.cluster_resolver.DaskClusterResolver(workers=[chosen])
    options = dd.ElasticOptions(min_replicas=2, max_replicas=2, wait_timeout="60s")
    with dd.MultiWorkerMirroredStrategy(resolver, communication_options=models.RING, client=threaded_client,
                                        elastic=options) as strategy:
        assert strategy.num_replicas_in_sync == 1
        with strategy.scope():
            model = models.model(weights)
        history = model.fit(models.train_set(), epochs=2, verbose=0)
        (event,) = history.elastic.events  # the newcomer joined before any step: it trained every step
        assert event.action == "grew" and event.admitted[0] in free and event.commit[1:] == (0, 0)
        assert strategy.num_replicas_in_sync == 2
        _check_exact(history, model, expected, reference)  # the global batch re-split: the same arithmetic
