"""A client that goes away mid-``fit``: its replicas stop and the group's shared memory is removed.

Real processes: the client is a separate Python script training a Keras model
on a cluster the test started (killed with SIGTERM or SIGKILL), or a script
whose strategy embeds its own cluster (stopped with SIGTERM or Ctrl-C). After
each, no ``daskdist-*`` segment of the group is left in ``/dev/shm`` within
seconds, and the cluster's workers still train.
"""

from __future__ import annotations

import _thread
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import daskdist as dd

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

DEADLINE = 10.0  # seconds after the client is gone by which its group's segments must be gone

_FIT = """
import os, sys
import numpy as np
import daskdist as dd
from daskdist import keras

def main():
    if sys.argv[1] == "embedded":
        strategy = dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    else:
        from distributed import Client
        strategy = dd.MirroredStrategy(client=Client(sys.argv[1]))
    pids = strategy.extended.client.run(os.getpid)
    print(strategy.extended.token, strategy.extended.group.group_id, *pids.values(), flush=True)
    x = np.random.default_rng(0).random((4096, 32)).astype(np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(64, input_shape=(32,)), keras.layers.Dense(2)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd")
    print("fitting", flush=True)

    class Training(keras.callbacks.Callback):  # says once that steps are done (the test then stops the script)
        said = False

        def on_train_batch_end(self, batch, logs=None):
            if batch >= 3 and not self.said:
                self.said = True
                print("training", flush=True)

    model.fit(dd.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=10_000, verbose=0,
              callbacks=[Training()])

if __name__ == "__main__":
    main()
"""


def _segments(group_id: str) -> list[str]:
    """The group's segments of every membership generation (``daskdist-<id>g<generation>-<src>-<dst>``)."""
    return glob.glob(f"/dev/shm/daskdist-{group_id.rsplit('-', 1)[-1]}g*-*")


def _poll(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_fit(tmp_path, where: str) -> tuple[subprocess.Popen, str, list[int]]:
    """A script training until it is stopped; its strategy token, group id and its workers' pids once it fits."""
    script = tmp_path / "fit.py"
    script.write_text(_FIT)
    # Ctrl-C as a user's terminal delivers it, also when this suite runs as a background job (where the shell
    # starts every process with SIGINT ignored, and Python then never raises KeyboardInterrupt)
    process = subprocess.Popen([sys.executable, str(script), where], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = process.stdout.readline().split()
    assert first, process.communicate(timeout=30)[1][-3000:]
    token, group_id, pids = first[0], first[1], [int(p) for p in first[2:]]
    assert process.stdout.readline().strip() == "fitting"
    assert _poll(lambda: len(_segments(group_id)) == 2, 30), "the group's shared-memory channels never appeared"
    return process, (token, group_id), pids


def _replicas_of(client, token: str) -> list:
    def replicas(dask_worker):
        return [key for key in dask_worker.extensions["daskdist"].replicas if key == token]

    return [r for rs in client.run(replicas).values() for r in rs]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_client_killed_mid_fit_leaves_no_segment_and_the_workers_train_on(make_cluster, tmp_path, sig):
    client = make_cluster(2, processes=True)
    process, (token, group_id), _ = _start_fit(tmp_path, client.scheduler.address)
    try:
        # mid-fit: steps are being reported
        assert _poll(lambda: any(e.get("group") == token for _, e in client.get_events("daskdist-steps")), 30)
        assert _replicas_of(client, group_id)
        process.send_signal(sig)
        process.wait(30)
        gone_at = time.monotonic()
        assert _poll(lambda: not _segments(group_id), DEADLINE), _segments(group_id)
        assert _poll(lambda: not _replicas_of(client, group_id), DEADLINE)
        assert time.monotonic() - gone_at < DEADLINE
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    with dd.MirroredStrategy(client=client) as strategy:
        total = strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(1000)))
        assert all(np.array_equal(v, np.full(1000, 2.0)) for v in strategy.experimental_local_results(total))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_stopping_a_script_with_an_embedded_cluster_mid_fit_cleans_up(tmp_path, sig):
    process, (_, group_id), worker_pids = _start_fit(tmp_path, "embedded")
    try:
        assert process.stdout.readline().strip() == "training"  # a few steps in (the script says so)
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    if sig == signal.SIGTERM:
        assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]  # what a shell shows for SIGTERM
        assert "closing the embedded cluster" in stderr
    else:
        assert process.returncode == -signal.SIGINT, stderr[-3000:]  # Python's own exit for an uncaught Ctrl-C
        assert "KeyboardInterrupt" in stderr  # the user's interrupt is raised, not swallowed
    assert _segments(group_id) == []  # removed before the script ended
    assert _poll(lambda: not any(_alive(p) for p in worker_pids), DEADLINE), "the embedded workers outlived it"


def test_ctrl_c_while_waiting_for_a_run_aborts_it_on_the_replicas(threaded_client, tmp_path):
    log = tmp_path / "replicas"

    def long_run():
        ctx = dd.get_replica_context()
        try:
            for _ in range(100_000):
                ctx.all_reduce("SUM", np.ones(8))
                time.sleep(0.001)
        except dd.CollectiveAbortedError as e:
            with open(log, "a") as f:
                f.write(f"{ctx.replica_id_in_sync_group} {e}\n")
            raise

    with dd.MirroredStrategy(client=threaded_client) as strategy:
        timer = threading.Timer(1.0, _thread.interrupt_main)  # Ctrl-C, one second into the run
        # interrupt_main does nothing where SIGINT is ignored (a suite run as a background job): Python's own handler
        handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                strategy.run(long_run)
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, handler)
        interrupted = time.monotonic()
        assert set(strategy.experimental_local_results(strategy.run(lambda: 7))) == {7}  # the replicas are free again
        assert time.monotonic() - interrupted < DEADLINE
        lines = _poll(lambda: log.exists() and len(log.read_text().splitlines()) == 3 and log.read_text(), DEADLINE)
        assert lines and all("stopped waiting" in line for line in lines.splitlines()), lines


def test_a_client_closed_without_closing_its_strategy_leaves_no_segment(process_client):
    from distributed import Client

    other = Client(process_client.scheduler.address, set_as_default=False)
    strategy = dd.MirroredStrategy(client=other)
    token = strategy.extended.group.group_id
    strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(10)))
    assert len(_segments(token)) == 2
    other.close()  # the strategy is never closed
    assert _poll(lambda: not _segments(token), DEADLINE), _segments(token)
    assert _poll(lambda: not _replicas_of(process_client, token), DEADLINE)
