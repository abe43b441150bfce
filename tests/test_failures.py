"""Failure and bad input on real clusters: every replica raises, nothing hangs, the client sees the cause."""

from __future__ import annotations

import os
import signal
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from tests.support.killers import RunInBackground, lines_of, wait_for_files, worker_pid


def test_a_replica_function_raises(threaded_client, tmp_path):
    marker = tmp_path / "aborted"
    with dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            if ctx.replica_id_in_sync_group == 1:
                raise KeyError("missing feature 'age'")
            try:
                return ctx.all_reduce("SUM", np.ones(3), dd.CommunicationOptions(timeout_seconds=60))
            except dd.CollectiveAbortedError as e:
                marker.write_text(str(e))
                raise

        start = time.monotonic()
        with pytest.raises(KeyError, match="missing feature 'age'") as info:
            strategy.run(fn)
        assert time.monotonic() - start < 30  # the others aborted at once, not after 60 s
        assert "replica 1" in "".join(getattr(info.value, "__notes__", []))
        assert "replica 1 raised KeyError" in marker.read_text()
        # the group is still usable after a user error
        out = strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(2)))
        assert strategy.experimental_local_results(out)[0].tolist() == [3.0, 3.0]


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda r: np.ones(3 + (r == 2)), "float64[4]"),
        (lambda r: np.ones(3, np.float32 if r else np.float64), "float32[3]"),
        (lambda r: {"w": np.ones(3)} if r else [np.ones(3)], "structure"),
    ],
    ids=["shape", "dtype", "structure"],
)
def test_mismatched_values_raise_everywhere(threaded_client, make, fragment):
    with dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            r = dd.get_replica_context().replica_id_in_sync_group
            try:
                dd.get_replica_context().all_reduce("SUM", make(r), dd.CommunicationOptions(timeout_seconds=60))
            except dd.CollectiveError as e:
                return type(e).__name__
            return "no error"

        start = time.monotonic()
        out = strategy.run(fn)
        assert time.monotonic() - start < 30  # at once, not after the 60 s deadline
        kinds = set(strategy.experimental_local_results(out))
        assert kinds <= {"CollectiveMismatchError", "CollectiveAbortedError"}
        assert "CollectiveMismatchError" in kinds

        with pytest.raises(dd.CollectiveMismatchError, match=fragment.replace("[", r"\[")):
            strategy.run(lambda: dd.get_replica_context().all_reduce(
                "SUM", make(dd.get_replica_context().replica_id_in_sync_group)))


def test_a_collective_one_replica_never_joins_times_out(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            if ctx.replica_id_in_sync_group == 2:
                return None
            return ctx.all_reduce("SUM", np.ones(2), dd.CommunicationOptions(timeout_seconds=1))

        start = time.monotonic()
        with pytest.raises(dd.CollectiveTimeoutError, match="replica 2") as info:
            strategy.run(fn)
        assert time.monotonic() - start < 20  # the 1 s deadline, not a hang
        assert "without joining this one" in str(info.value)

        # the configured default applies when options give no timeout
        with dask.config.set({"daskdist.collective.timeout": "1s"}):
            start = time.monotonic()
            with pytest.raises(dd.CollectiveTimeoutError, match="replica 2"):
                strategy.run(lambda: fn.__wrapped__() if hasattr(fn, "__wrapped__") else _skip_on_two())
            assert time.monotonic() - start < 20


def _skip_on_two():
    ctx = dd.get_replica_context()
    if ctx.replica_id_in_sync_group == 2:
        return None
    return ctx.all_reduce("SUM", np.ones(2))


class TestImpossibleRequests:
    def test_gpu_devices_without_gpus(self, threaded_client):
        start = time.monotonic()
        with pytest.raises(ValueError, match="GPU"):
            dd.MirroredStrategy(devices=["/gpu:0"])
        with pytest.raises(ValueError, match="no worker of this cluster has a GPU"):
            dd.MirroredStrategy(devices=["/gpu:0", "/gpu:1"], client=threaded_client)
        assert time.monotonic() - start < 10

    def test_more_replicas_than_workers(self, threaded_client):
        with pytest.raises(ValueError, match="only 3 CPU worker"):
            dd.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(5)], client=threaded_client)

    @pytest.mark.parametrize(
        "devices, message",
        [
            (["/tpu:0"], "Unknown device"),
            (["cpu:x"], "Unknown device"),
            (["/job:worker/task:1/device:CPU:0"], "job 'localhost'"),
            (["/cpu:0", "CPU:0"], "listed twice"),
            (["/cpu:0", "/gpu:0"], "Mixing"),
            ([], "at least one"),
            ("/cpu:0", "list"),
        ],
    )
    def test_bad_device_strings(self, devices, message):
        with pytest.raises((ValueError, TypeError), match=message):
            dd.MirroredStrategy(devices=devices)

    def test_bad_configuration_fails_at_once(self, threaded_client):
        start = time.monotonic()
        with dask.config.set({"daskdist.collective.transport": "carrier-pigeon"}):
            with pytest.raises(ValueError, match="carrier-pigeon"):
                dd.MirroredStrategy(client=threaded_client)
        with dask.config.set({"daskdist.collective.shm.slot-bytes": "1 parsec"}):
            with pytest.raises(ValueError):
                dd.MirroredStrategy(client=threaded_client)
        assert time.monotonic() - start < 10

    def test_a_replica_that_cannot_start_fails_the_strategy_at_once(self, threaded_client):
        start = time.monotonic()
        # forcing shm while every replica counts as its own host: each replica fails while starting
        with dask.config.set({"daskdist.collective.hosts": "blocks:1", "daskdist.collective.transport": "shm"}):
            with pytest.raises(dd.RendezvousError, match="failed to start"):
                dd.MirroredStrategy(client=threaded_client)
        assert time.monotonic() - start < 10

    def test_a_closed_strategy_refuses_work(self, threaded_client):
        strategy = dd.MirroredStrategy(client=threaded_client)
        with strategy.scope():
            v = dd.Variable(1.0)
        strategy.close()
        with pytest.raises(dd.StrategyClosedError, match="closed"):
            strategy.run(lambda: 1)
        with pytest.raises(dd.StrategyClosedError):
            with strategy.scope():
                pass
        with pytest.raises(dd.StrategyClosedError):
            v.numpy()

    def test_wrong_argument_types(self, threaded_client):
        with dd.MirroredStrategy(client=threaded_client) as strategy:
            with pytest.raises(TypeError, match="callable"):
                strategy.run(42)
            with pytest.raises(TypeError, match="args must be a tuple"):
                strategy.run(lambda x: x, args=np.ones(2))
            with pytest.raises(ValueError, match="Unknown reduce op"):
                strategy.reduce("AVG", dd.PerReplica([1.0, 2.0, 3.0]))
            with pytest.raises(TypeError, match="MEAN is not defined for bool"):
                strategy.run(lambda: dd.get_replica_context().all_reduce("MEAN", np.array([True])))
        with pytest.raises(TypeError, match="Client"):
            dd.MirroredStrategy(client="tcp://127.0.0.1:8786")


@pytest.mark.slow
def test_a_killed_worker_fails_every_replica_and_the_client(make_cluster, tmp_path):
    client = make_cluster(3, processes=True)
    strategy = dd.MirroredStrategy(client=client)
    victim = strategy.extended.worker_addresses[1]
    pid = worker_pid(client, victim)
    log = tmp_path / "lost"

    def fn():
        ctx = dd.get_replica_context()
        (tmp_path / f"ready{ctx.replica_id_in_sync_group}").write_text("")
        if ctx.replica_id_in_sync_group == 1:
            time.sleep(60)  # killed while the others wait for it inside the all-reduce
        start = time.monotonic()
        try:
            return ctx.all_reduce("SUM", np.ones(1_000_000, np.float32), dd.CommunicationOptions(timeout_seconds=120))
        except dd.ReplicaLostError as e:
            with open(log, "a") as f:
                f.write(f"{ctx.replica_id_in_sync_group} {time.monotonic() - start:.2f} {e}\n")
            raise

    run = RunInBackground(strategy, fn)
    wait_for_files(tmp_path, "ready*", 3)  # every replica is in the step: 1 asleep, the others at the all-reduce
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    error = run.join(30)
    assert isinstance(error, dd.ReplicaLostError), repr(error)
    assert victim in str(error)
    assert run.at - killed_at < 10
    lines = lines_of(log, 2)
    assert sorted(line.split()[0] for line in lines) == ["0", "2"]  # every surviving replica raised
    assert all(float(line.split()[1]) < 12 for line in lines)
    assert all(victim in line for line in lines)

    with pytest.raises(dd.StrategyClosedError, match="failed"):
        strategy.run(lambda: 1)
    strategy.close()


@pytest.mark.slow
def test_a_worker_killed_between_steps(make_cluster):
    client = make_cluster(2, processes=True)
    with dd.MirroredStrategy(client=client) as strategy:
        strategy.run(lambda: 1)
        victim = strategy.extended.worker_addresses[0]
        os.kill(worker_pid(client, victim), signal.SIGKILL)
        time.sleep(1)
        start = time.monotonic()
        with pytest.raises(dd.ReplicaLostError, match="replica 0"):
            strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(3)))
        assert time.monotonic() - start < 10
        with pytest.raises(dd.StrategyClosedError):
            strategy.run(lambda: 1)


def test_replicas_stop_when_their_client_disconnects(threaded_client):
    from distributed import Client

    other = Client(threaded_client.scheduler.address, set_as_default=False)
    strategy = dd.MirroredStrategy(client=other)
    group_id = strategy.extended.group.group_id
    strategy.run(lambda: 1)

    def replicas_of_group(dask_worker):
        return [key for key in dask_worker.extensions["daskdist"].replicas if key == group_id]

    assert any(threaded_client.run(replicas_of_group).values())
    other.close()  # the client goes away without closing the strategy
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(threaded_client.run(replicas_of_group).values()):
        time.sleep(0.1)
    assert not any(threaded_client.run(replicas_of_group).values())
