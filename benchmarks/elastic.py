"""Elastic training: the cost of committing, the time from a kill -9 (or SIGSTOP) to training again, goodput.

Four parts, all with the tutorial's CNN (``examples/mnist_mirrored.py``,
MNIST-shaped synthetic data, ``map(scale).cache().batch(64)``: the tutorial's
pipeline without its shuffle, so that plain and elastic read the same input:
elastic ``fit`` turns a shuffle into a seeded full permutation planned each
epoch, a plain strategy into per-replica buffers):

1. **Commit cost.** ``fit`` on 2 replicas (a ``LocalCluster``), epochs
   alternating (ABBA) between a plain (non-elastic) strategy and elastic ones
   with ``commit_every`` 1 and 10, side by side in one run, one
   ``fit(epochs=--fit-epochs)`` (2) of each per round (a warm-up fit first).
   Reported: the median time per step of the epochs after each fit's first
   (``on_epoch_begin`` to ``on_epoch_end``, over the steps: the commits, the
   commit-boundary checks, the epoch command), each one's ratio to the plain
   one (goal: under 1.03 at ``commit_every=1``), and the same of each fit's
   wall time (the fit's one-off start included: the data planned, the first
   commit).
2. **Goodput with a kill -9 every epoch.** 3 ``dask worker`` processes (each
   with its nanny) on a fresh scheduler per run; ``--goodput-epochs`` (10)
   epochs of ``fit``. In every epoch, once replica 0 reported step
   ``steps // 2``, a worker of the group (rank 1) is killed with its nanny
   (SIGKILL, nothing restarts it) and a replacement ``dask worker`` is started
   (a spot instance replaced), so that every run has 3 workers to use:

   * *uninterrupted*: the plain strategy, no kill;
   * *elastic*: ``ElasticOptions(min_replicas=2, max_replicas=3,
     admit_every="1s")`` (``--min-replicas 1`` for 1): fit goes on on the
     survivors from the newest commit and admits the replacement at the next
     commit boundary once it is up (with ``min_replicas=2`` a kill before it is
     up leaves 1 replica: below ``min_replicas`` the recovery waits for it);
   * *restart + BackupAndRestore*: what a user has today: the plain strategy
     with ``keras.callbacks.BackupAndRestore``; the kill ends ``fit`` with
     ``ReplicaLostError``, the user's loop waits for 3 workers, makes a new
     strategy and model and calls ``fit`` again, which resumes after the last
     finished epoch (the killed epoch's steps are trained again).

   Reported: wall time, goodput (samples of the 10 epochs / wall time) and its
   ratio to the uninterrupted run.
3. **Kill -9 to the first step of the new generation**, from the elastic run's
   kills: per kill, seconds from the kill to the end of the recovery
   (``History.elastic_events``' ``time``: the new generation formed, the commit
   restored) and to the start of replica 0's first step after it (the step's
   own wall-clock start, from the scheduler's step store); mean and range.

4. **Stopped** (``stop``; ``recovery`` is the same with SIGKILL): per trial a
   fresh cluster of 3 ``dask worker`` processes, one worker and its nanny get
   SIGSTOP mid-epoch: the processes live and keep their sockets open but
   answer nothing; the scheduler declares the worker lost when its heartbeats
   stop for ``daskdist.elastic.heartbeat-timeout``. Reported, per trial:
   seconds from the signal to the recovery event and to the first step of the
   new generation (replica 0's first progress event after it).

``--model keras3``: the same parts with the tutorial's CNN in real
Keras 3 on its torch backend (``keras3_training.keras3_cnn``: Conv2D(32, 3) -
MaxPooling2D - Flatten - Dense(64) - Dense(10), Adam, accuracy) built in the
strategy's scope, ``fit`` as ``tests/test_keras3_elastic.py`` runs it (Keras and
torch imported on the workers before the group starts); a commit snapshots the
``KerasTrainable`` (weights, Adam's slots, the epoch's metric totals).
``commit``, ``recovery``, ``stop`` and ``snapshot`` only: ``goodput``'s restart
arm (``BackupAndRestore`` under a plain strategy) is not written for Keras 3
(its elastic arm would now grow into the replacement workers at commits).

``--model torch``: a ``TorchModel`` (the CNN in PyTorch, Adam, stock DDP on the
``daskdist`` backend) in a ``dd.elastic.State`` custom loop, ``commit`` and
``snapshot`` only (``training_parts/torch_elastic.py``: torch has no ``fit``).

Run: ``python benchmarks/elastic.py [--min-replicas 1|2] [--parts commit,goodput,stop]``
(commit and goodput: 330 s on 2 cores at load 15-20); ``--quick`` (2 measured
epochs, 16 steps, 3 goodput epochs, 1 trial) is a smoke run;
``python benchmarks/elastic.py --model keras3 --parts commit,recovery`` the Keras 3 figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cloudpickle  # noqa: E402
from _common import alternating_arm_times, arm_times_table, format_table, local_cluster, print_header  # noqa: E402
from training_parts import keras_parts  # noqa: E402
from training_parts.keras_parts import build_cnn, scale  # noqa: E402

# the `dask worker` processes of the kill trials do not have benchmarks/ on their path: ship `scale` by value
cloudpickle.register_pickle_by_value(keras_parts)

import daskdist as dd  # noqa: E402
from daskdist import keras  # noqa: E402
from daskdist.elastic.recovery import ELASTIC_TOPIC  # noqa: E402
from daskdist.training.progress import PROGRESS_TOPIC  # noqa: E402

BATCH = 64
MODEL = {"name": "builtin"}  # --model: builtin (daskdist.keras) or keras3 (Keras 3, torch backend)


def build_model():
    """The tutorial's CNN of ``--model``, compiled (call in a strategy's scope)."""
    if MODEL["name"] == "keras3":
        from keras3_training import keras3_cnn

        return keras3_cnn()
    return build_cnn()


def prepare_workers(client) -> None:
    """Keras 3: Keras and torch imported on the workers before a group starts (a long import under load would
    miss the group's heartbeats), as ``tests/test_keras3_elastic.py`` does."""
    if MODEL["name"] == "keras3":
        from daskdist.plugins.keras3.backend import prepare_replica

        client.run(prepare_replica, "torch")


def dataset(steps: int):
    rng = np.random.default_rng(0)
    rows = steps * BATCH
    images = rng.integers(0, 256, (rows, 28, 28, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, rows).astype(np.int64)
    return dd.data.Dataset.from_tensor_slices((images, labels)).map(scale).cache().batch(BATCH)


def epoch_timer(cpu: Callable[[], float]) -> Any:
    """A callback of ``--model``'s framework that times each epoch (``on_epoch_begin`` to ``on_epoch_end``): its
    wall time (``seconds``) and the CPU time ``cpu()`` counts over it (``cpu_seconds``, read outside the wall's
    window)."""
    if MODEL["name"] == "keras3":
        import keras as framework
    else:
        framework = keras

    class EpochTimes(framework.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self.cpu_seconds: list[float] = []
            self._start = self._cpu = 0.0

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self._cpu = cpu()
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self.seconds.append(time.perf_counter() - self._start)
            self.cpu_seconds.append(cpu() - self._cpu)

    return EpochTimes()


def _cpu_seconds() -> float:
    """CPU time (user + system, every thread) of this process so far (run on the workers)."""
    times = os.times()
    return times.user + times.system


def commit_cost(epochs: int, steps: int, profile: bool = False, fit_epochs: int = 2) -> None:
    """Each round: one ``fit(epochs=fit_epochs)`` of each strategy (ABBA). Per step: the later epochs' own time
    (``on_epoch_begin`` to ``on_epoch_end``: the epoch's commits, its commit-boundary checks and its command)
    and the fit's wall time (with the fit's one-off start: planning the data, the first commit)."""
    kinds = {"plain": None, "commit_every=1": dd.ElasticOptions(1, commit_every=1),
             "commit_every=10": dd.ElasticOptions(1, commit_every=10)}
    times: dict[str, list[float]] = {k: [] for k in kinds}  # the later epochs of each fit, per step
    cpu: dict[str, list[float]] = {k: [] for k in kinds}  # their CPU time on the replicas (both summed), per step
    walls: dict[str, list[float]] = {k: [] for k in kinds}  # each fit's wall time, per step
    train = dataset(steps)
    with local_cluster(2) as client:
        prepare_workers(client)
        strategies = {k: dd.MirroredStrategy(client=client, elastic=o) for k, o in kinds.items()}
        models = {}
        for name, strategy in strategies.items():
            with strategy.scope():
                models[name] = build_model()
            models[name].fit(train, epochs=1, verbose=0)  # warm-up
        order = list(kinds)
        loads = []
        for epoch in range(epochs):
            loads.append(os.getloadavg()[0])
            print(f"round {epoch + 1}: load before {loads[-1]:.2f}", flush=True)
            for name in (order if epoch % 2 == 0 else order[::-1]):
                timer = epoch_timer(lambda: sum(client.run(_cpu_seconds).values()))
                start = time.perf_counter()
                models[name].fit(train, epochs=fit_epochs, verbose=0, callbacks=[timer])
                walls[name].append((time.perf_counter() - start) / steps / fit_epochs)
                times[name] += [t / steps for t in timer.seconds[1:]]
                cpu[name] += [t / steps for t in timer.cpu_seconds[1:]]
        med = statistics.median
        plain, plain_wall, plain_cpu = med(times["plain"]), med(walls["plain"]), med(cpu["plain"])
        rows = [[name, f"{med(t) * 1e3:.2f}", f"{med(t) / plain:.3f}", f"{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}",
                 f"{med(cpu[name]) * 1e3:.2f}", f"{med(cpu[name]) / plain_cpu:.3f}",
                 f"{med(walls[name]) * 1e3:.2f}", f"{med(walls[name]) / plain_wall:.3f}"] for name, t in times.items()]
        print(f"\nload (1 min) before the rounds: {min(loads):.2f}-{max(loads):.2f}; fit(epochs={fit_epochs}) per "
              f"round, {steps} steps per epoch\n")
        print(format_table(["strategy", "epoch ms per step (median)", "ratio to plain", "range (ms)",
                            "replicas' CPU ms per step", "ratio to plain", "fit wall ms per step", "ratio to plain"],
                           rows), flush=True)
        print("(epoch: the epochs after each fit's first, on_epoch_begin to on_epoch_end; replicas' CPU: their "
              "processes' CPU time over those epochs, summed; fit wall: the whole fit, its start included)")
        if profile:
            parts = commit_profile(client, models, train, steps, max(2, epochs // 2))
        for strategy in strategies.values():
            strategy.close()
    if profile:
        print("\nWhere a step's time goes on the replicas (ABAB rounds of fit(epochs=2), timed by wrappers installed on "
              "the workers; ms per step, the median over the rounds of the mean over the replicas):\n")
        print(format_table(["strategy", "replica's epoch command", "train step", "before_step",
                            "of which: wait for the copy (settle)", "after_step", "epoch-end commit (commit_now)",
                            "commit parts together"], parts))


_PARTS = ("command", "train_batch", "before_step", "settle", "after_step", "commit_now")


def _install_timers(model: str) -> None:
    """On a worker: time the replica's epoch command (``train_epoch``, ``elastic_train_epoch``), the model's
    ``train_batch`` (a step), what a commit costs before a step (``Commits.before_step``: the boundary flags),
    the wait for a commit's copy before the apply (``CommitRing.settle``), what a commit costs after a step
    (``Commits.after_step``: the metric totals read, the commit kept or its copy's thread started) and the
    epoch's last commit (``commit_now``); sums and counts."""
    import types

    from daskdist.elastic import replica
    from daskdist.training import commands
    from daskdist.training import elastic as trainer_elastic
    from daskdist.training.commits import Commits

    if model == "keras3":
        from daskdist.plugins.keras3.resident import KerasTrainable as Resident
    else:
        from daskdist.keras.trainable import BuiltinTrainable as Resident

    if "k3bench_timers" in sys.modules:
        return
    timers = types.ModuleType("k3bench_timers")
    timers.totals = {name: [0.0, 0] for name in _PARTS}  # type: ignore[attr-defined]
    sys.modules["k3bench_timers"] = timers

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = timers.totals[name]  # type: ignore[attr-defined]
                total[0] += time.perf_counter() - start
                total[1] += 1
        return wrapper

    commands.train_epoch = timed("command", commands.train_epoch)
    trainer_elastic.elastic_train_epoch = timed("command", trainer_elastic.elastic_train_epoch)
    Resident.train_batch = timed("train_batch", Resident.train_batch)  # type: ignore[method-assign]
    replica.CommitRing.settle = timed("settle", replica.CommitRing.settle)  # type: ignore[method-assign]
    Commits.before_step = timed("before_step", Commits.before_step)  # type: ignore[method-assign]
    Commits.after_step = timed("after_step", Commits.after_step)  # type: ignore[method-assign]
    trainer_elastic.commit_now = timed("commit_now", trainer_elastic.commit_now)


def _take_timers() -> dict:
    """On a worker: the sums and counts since the last call, reset."""
    timers = sys.modules["k3bench_timers"]
    taken = {name: tuple(total) for name, total in timers.totals.items()}  # type: ignore[attr-defined]
    timers.totals = {name: [0.0, 0] for name in _PARTS}  # type: ignore[attr-defined]
    return taken


def commit_profile(client, models: dict, train, steps: int, rounds: int) -> list[list[str]]:
    """ABAB rounds of ``fit(epochs=2)`` of the plain and the ``commit_every=1`` model, the parts timed on the
    replicas (ms per step: the mean over the replicas, the median over the rounds)."""
    client.run(_install_timers, MODEL["name"])
    order = ["plain", "commit_every=1"]
    per_round: dict[str, dict[str, list[float]]] = {name: {part: [] for part in _PARTS} for name in order}
    for n in range(rounds):
        for name in (order if n % 2 == 0 else order[::-1]):
            client.run(_take_timers)
            models[name].fit(train, epochs=2, verbose=0)
            taken = list(client.run(_take_timers).values())
            for part in _PARTS:
                per_round[name][part].append(statistics.mean(t[part][0] for t in taken) / (2 * steps))
    rows = []
    for name in order:
        med = {part: statistics.median(values) * 1e3 for part, values in per_round[name].items()}
        commit = med["before_step"] + med["after_step"] + med["settle"] + med["commit_now"]
        rows.append([name] + [f"{med[part]:.3f}" for part in _PARTS] + [f"{commit:.3f}"])
    return rows


class ProcessWorkers:
    """A scheduler in this process and ``dask worker`` processes (each with its nanny) that may be killed."""

    def __init__(self, n: int):
        from distributed import Client, LocalCluster

        self.cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=40)
        self.client = Client(self.cluster, set_as_default=False)
        self._command = [os.path.join(os.path.dirname(sys.executable), "dask"), "worker",
                         self.cluster.scheduler_address, "--nthreads", "1", "--no-dashboard"]
        self.processes: list[subprocess.Popen] = []
        for _ in range(n):
            self.start_one()
        self.client.wait_for_workers(n, timeout=120)

    def start_one(self) -> None:
        self.processes.append(subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def kill(self, address: str) -> float:
        """SIGKILL the worker at ``address`` and its nanny; the wall-clock time of the kill."""
        worker, nanny = self.client.run(lambda: (os.getpid(), os.getppid()), workers=[address])[address]
        at = time.time()
        os.kill(nanny, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        return at

    def close(self) -> None:
        self.client.close()
        self.cluster.close()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)


class KillEveryEpoch(threading.Thread):
    """Kills rank 1 of the current group once per epoch (at replica 0's step ``step``) and starts a replacement."""

    def __init__(self, workers: ProcessWorkers, members: Callable[[], list[str]], step: int, epochs: int):
        super().__init__(daemon=True)
        self.workers, self.members, self.step, self.epochs = workers, members, step, epochs
        self.kills: list[float] = []  # wall-clock times
        self.failed: list[str] = []  # kill attempts that failed (the group was between generations), retried
        self.stopped = threading.Event()
        self.since = time.time()

    def run(self) -> None:
        killed: set[int] = set()
        while not self.stopped.is_set() and len(killed) < self.epochs:
            events = self.workers.client.get_events(PROGRESS_TOPIC)
            due = sorted({m.get("epoch") for t, m in events if t > self.since and m.get("epoch") not in killed
                          and m.get("step", -1) >= self.step})
            if not due:
                time.sleep(0.02)
                continue
            try:
                victim = self.members()[1]
                self.kills.append(self.workers.kill(victim))
            except Exception as e:  # noqa: BLE001 - the group is between generations (or restarting): try again
                self.failed.append(f"{type(e).__name__}: {e}")
                time.sleep(0.1)
                continue
            killed.add(int(due[0]))
            self.workers.start_one()


def _first_steps_after(dask_scheduler: object, token: str, times: list[float]) -> list[float | None]:
    """Per wall-clock time, the start of rank 0's first step after it (the scheduler's step store)."""
    group = dask_scheduler.extensions["daskdist"].store.groups.get(token)  # type: ignore[attr-defined]
    starts = sorted(step["start"] for step in group.replicas[0].history) if group is not None else []
    return [next((s for s in starts if s >= t), None) for t in times]


def _run_uninterrupted(epochs: int, steps: int) -> tuple[float, str]:
    workers = ProcessWorkers(3)
    try:
        with dd.MirroredStrategy(client=workers.client) as strategy:
            with strategy.scope():
                model = build_model()
            start = time.perf_counter()
            model.fit(dataset(steps), epochs=epochs, verbose=0)
            return time.perf_counter() - start, "-"
    finally:
        workers.close()


def _run_elastic(epochs: int, steps: int, min_replicas: int
                 ) -> tuple[float, str, list[tuple[float, float, float | None]]]:
    """Wall time, a note, and per kill (kill -> recovered, recovery's own seconds, kill -> first step after)."""
    workers = ProcessWorkers(3)
    try:
        options = dd.ElasticOptions(min_replicas=min_replicas, max_replicas=3, admit_every="1s")
        with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
            with strategy.scope():
                model = build_model()
            killer = KillEveryEpoch(workers, lambda: list(strategy.extended.worker_addresses), steps // 2, epochs)
            killer.start()
            start = time.perf_counter()
            history = model.fit(dataset(steps), epochs=epochs, verbose=0)
            wall = time.perf_counter() - start
            killer.stopped.set()
            killer.join(10)
            time.sleep(2.5)  # the last steps reach the scheduler's store (daskdist.metrics.event-interval: 1 s)
            restored = [e for e in history.elastic_events if e["action"] == "restored"]
            firsts = workers.client.run_on_scheduler(_first_steps_after, token=strategy.extended.token,
                                                     times=[e["time"] for e in restored])
            per_kill = []
            for event, first in zip(restored, firsts):  # each recovery with the kill before it (a kill at the
                kill = max((k for k in killer.kills if k <= event["time"]), default=None)  # very end has none)
                if kill is not None:
                    per_kill.append((event["time"] - kill, event["seconds"], None if first is None else first - kill))
            grew = sum(1 for e in history.elastic_events if e["action"] == "grew")
            if killer.failed:
                print(f"  ({len(killer.failed)} kill attempts retried; last: {killer.failed[-1]})")
            return wall, f"{len(killer.kills)} kills, {len(restored)} recoveries, {grew} growths", per_kill
    finally:
        workers.close()


def _run_restarts(epochs: int, steps: int) -> tuple[float, str]:
    """The plain strategy with BackupAndRestore, ``fit`` called again after each loss (the user's loop)."""
    from daskdist.exceptions import DaskdistError

    workers = ProcessWorkers(3)
    backup = tempfile.mkdtemp(prefix="daskdist-bench-backup-")
    current: dict[str, list[str]] = {"members": []}
    killer = KillEveryEpoch(workers, lambda: current["members"], steps // 2, epochs)
    restarts = 0
    try:
        killer.start()
        start = time.perf_counter()
        while True:
            workers.client.wait_for_workers(3, timeout=120)
            try:
                with dd.MirroredStrategy(client=workers.client) as strategy:
                    current["members"] = list(strategy.extended.worker_addresses)
                    with strategy.scope():
                        model = build_model()
                    model.fit(dataset(steps), epochs=epochs, verbose=0,
                              callbacks=[keras.callbacks.BackupAndRestore(backup)])
                break
            except DaskdistError:
                restarts += 1
                current["members"] = []
                time.sleep(0.1)
        wall = time.perf_counter() - start
        killer.stopped.set()
        killer.join(10)
        return wall, f"{len(killer.kills)} kills, {restarts} restarts"
    finally:
        shutil.rmtree(backup, ignore_errors=True)
        workers.close()


def goodput(epochs: int, steps: int, min_replicas: int) -> None:
    samples = epochs * steps * BATCH
    runs = [("uninterrupted", *_run_uninterrupted(epochs, steps))]
    wall, note, per_kill = _run_elastic(epochs, steps, min_replicas)
    runs.append((f"elastic (min_replicas={min_replicas}), a kill -9 per epoch", wall, note))
    runs.append(("restart + BackupAndRestore, a kill -9 per epoch", *_run_restarts(epochs, steps)))
    base = samples / runs[0][1]
    rows = [[name, f"{wall:.1f}", f"{samples / wall:,.0f}", f"{samples / wall / base:.2f}", note]
            for name, wall, note in runs]
    print(format_table(["run", "wall s", "goodput samples/s", "vs uninterrupted", "events"], rows))
    print(f"\n## Kill -9 to the first step of the new generation (the elastic run's {len(per_kill)} kills)\n")
    rows = [[str(i), f"{r:.2f}", f"{s:.2f}", "-" if f is None else f"{f:.2f}"] for i, (r, s, f) in enumerate(per_kill)]
    print(format_table(["kill", "kill -> recovered (s)", "recovery itself (s)", "kill -> first step (s)"], rows))
    firsts = [f for _, _, f in per_kill if f is not None]
    if firsts:
        print(f"\nkill -> first step of the new generation: mean {statistics.mean(firsts):.2f} s "
              f"(min {min(firsts):.2f}, max {max(firsts):.2f}, {len(firsts)} kills)")


def _kill_mid_epoch(client, step: int, pids: tuple[int, ...], killed: dict, how: int = signal.SIGKILL) -> None:
    """Send ``how`` to ``pids`` once replica 0 reported ``step``; the kill's time goes in ``killed["at"]``."""
    since = time.time()
    while not any(t > since and m.get("step", -1) >= step for t, m in client.get_events(PROGRESS_TOPIC)):
        time.sleep(0.01)
    killed["at"] = time.time()
    for pid in pids:
        os.kill(pid, how)


def recovery(trials: int, steps: int, how: int = signal.SIGKILL) -> None:
    from distributed import Client, LocalCluster

    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    results = []
    for _ in range(trials):
        print(f"trial: load before {os.getloadavg()[0]:.2f}", flush=True)
        cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=40)
        client = Client(cluster, set_as_default=False)
        nannies = [subprocess.Popen([dask, "worker", cluster.scheduler_address, "--nthreads", "1",
                                     "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for _ in range(3)]
        try:
            client.wait_for_workers(3, timeout=120)
            prepare_workers(client)
            with dd.MirroredStrategy(client=client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
                with strategy.scope():
                    model = build_model()
                victim = strategy.extended.worker_addresses[1]
                worker, nanny = client.run(lambda: (os.getpid(), os.getppid()), workers=[victim])[victim]
                killed: dict[str, float] = {}
                thread = threading.Thread(target=_kill_mid_epoch,
                                          args=(client, steps // 2, (nanny, worker), killed, how), daemon=True)
                thread.start()
                model.fit(dataset(steps), epochs=2, verbose=0)
                thread.join(10)
                restored = min(t for t, m in client.get_events(ELASTIC_TOPIC) if m.get("action") == "restored")
                first = min(t for t, m in client.get_events(PROGRESS_TOPIC) if t > restored)
                results.append((restored - killed["at"], first - killed["at"]))
                if how != signal.SIGKILL:
                    for pid in (nanny, worker):  # stopped, not dead: end them
                        os.kill(pid, signal.SIGKILL)
        finally:
            client.close()
            cluster.close()
            for process in nannies:
                process.kill()
                process.wait(10)
    rows = [[str(i), f"{r:.2f}", f"{f:.2f}"] for i, (r, f) in enumerate(results)]
    print(format_table(["trial", "kill -> restored (s)", "kill -> first step after (s)"], rows))
    print("(the first step is seen through replica 0's progress events, sent at most every 0.25 s)")


def snapshot_cost(steps: int) -> None:
    """In this process, no cluster: the model's training step (Keras 3's, or the built-in layers') on one replica's batch, alone and followed by what a
    commit costs the step (alternated, 4 steps per sample, so that the next steps' cache misses count):

    * *full copy*: the snapshot of every commit before (``KerasTrainable.snapshot``: weights, optimizer slots,
      seeds, metric totals, copied), which a full commit still takes once per ``elastic.replayed-commits``;
    * *replayed commit*: what a commit between two full ones takes on the step path
      (``KerasTrainable.step_state`` and ``local_metric_totals``; its steps' reduced gradients are kept, not copied).
    """
    rng = np.random.default_rng(0)
    if MODEL["name"] == "keras3":
        import torch

        from daskdist.plugins.keras3.resident import KerasTrainable

        torch.set_num_threads(1)  # one replica's share of the 2 cores
        model = build_model()
        x = torch.from_numpy(rng.random((BATCH // 2, 28, 28, 1), dtype=np.float32))
        y = torch.from_numpy(rng.integers(0, 10, BATCH // 2).astype(np.int64))
        model.train_step((x, y))  # the optimizer's slots built
        resident: Any = KerasTrainable(model)
        step = lambda: model.train_step((x, y))  # noqa: E731
        weights = "variables"
    else:  # the built-in layers: the trainer's step (``BuiltinTrainable.train_batch``) with the SPMD driver
        from daskdist.keras.trainable import BuiltinTrainable
        from daskdist.strategy.drivers.contract import SpmdStepDriver

        model = build_model()
        x = rng.random((BATCH // 2, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, BATCH // 2).astype(np.int64)
        resident = BuiltinTrainable(model)
        driver = SpmdStepDriver()
        resident.train_batch((x, y), driver)  # built, the optimizer's slots made
        step = lambda: resident.train_batch((x, y), driver)  # noqa: E731
        weights = "weights"
    state = resident.snapshot()
    arms = {
        "plain step": step,
        "plain step (again: the noise)": step,
        "step + full copy": lambda: (step(), resident.snapshot()),
        "step + replayed commit": lambda: (step(), resident.step_state(), resident.local_metric_totals()),
    }
    times = alternating_arm_times(arms, steps)
    optimizer = state["optimizer"]
    slots = list(optimizer.values()) if isinstance(optimizer, dict) else list(optimizer)
    nbytes = sum(np.asarray(a).nbytes for a in list(state[weights]) + slots)
    print(f"load before: {os.getloadavg()[0]:.2f}; {MODEL['name']}; {steps} alternations of 4 steps; "
          f"a full copy is {nbytes:,} bytes (weights + Adam's slots)")
    print(arm_times_table(times))


def torch_elastic_parts(parts: set[str], epochs: int, steps: int) -> None:
    """``--model torch``: a ``TorchModel``'s commit in a custom loop (``training_parts/torch_elastic.py``)."""
    from training_parts import torch_elastic, torch_parts

    cloudpickle.register_pickle_by_value(torch_parts)  # the workers do not have benchmarks/ on their path
    cloudpickle.register_pickle_by_value(torch_elastic)
    print_header("Elastic training, a TorchModel in a dd.elastic.State loop")
    if "commit" in parts:
        print("\n## Commit cost per step\n")
        torch_elastic.commit_cost(epochs, steps, format_table, local_cluster)
    if "snapshot" in parts:
        print("\n## A commit against the replica's own step, in one process\n")
        torch_elastic.snapshot_cost(steps * 2, alternating_arm_times, arm_times_table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6, help="measured epochs per strategy (commit cost)")
    parser.add_argument("--steps", type=int, default=32, help="steps per epoch")
    parser.add_argument("--fit-epochs", type=int, default=2,
                        help="commit cost: epochs of each fit (every epoch after the first is timed)")
    parser.add_argument("--goodput-epochs", type=int, default=10, help="epochs of each goodput run")
    parser.add_argument("--min-replicas", type=int, default=2, choices=[1, 2],
                        help="the elastic goodput run's min_replicas (1: fit never waits for a replacement)")
    parser.add_argument("--trials", type=int, default=3, help="kills (recovery) and stops (stop), one cluster each")
    parser.add_argument("--parts", default="commit,goodput,stop",
                        help="which parts, comma-separated: commit, goodput (a kill -9 per epoch, with kill -> "
                             "first step per kill), recovery (kill -9, one per cluster), stop (SIGSTOP), snapshot "
                             "(a commit's snapshot against the model's step, in this process)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 epochs, 16 steps, 3 goodput epochs, 1 trial")
    parser.add_argument("--model", choices=["builtin", "keras3", "torch"], default="builtin",
                        help="the tutorial's CNN in daskdist's built-in layers, in Keras 3 (torch backend) or in "
                             "PyTorch (a TorchModel in a custom loop: commit and snapshot only)")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.steps, args.goodput_epochs, args.trials = 2, 16, 3, 1
    parts = set(args.parts.split(","))
    MODEL["name"] = args.model
    if args.model == "keras3":
        if "goodput" in parts:
            parser.error("--model keras3 measures commit, recovery, stop and snapshot (goodput's restart arm, "
                         "BackupAndRestore, is not written for Keras 3)")
        os.environ["KERAS_BACKEND"] = "torch"  # before Keras is imported, here and in the workers started
    if args.model == "torch":
        if parts - {"commit", "snapshot"}:
            parser.error("--model torch measures commit and snapshot (a TorchModel in a custom loop)")
        torch_elastic_parts(parts, args.epochs, args.steps)
        return
    print_header("Elastic training")
    if args.model == "keras3":
        import keras
        import torch

        print(f"Keras {keras.__version__} backend {keras.backend.backend()}, torch {torch.__version__}")
    begin = time.perf_counter()
    if "commit" in parts:
        print("\n## Commit cost per step\n")
        commit_cost(args.epochs, args.steps, profile=True, fit_epochs=args.fit_epochs)
    if "goodput" in parts:
        print(f"\n## Goodput of {args.goodput_epochs} epochs of {args.steps} steps, a kill -9 per epoch\n")
        goodput(args.goodput_epochs, args.steps, args.min_replicas)
    if "snapshot" in parts:
        print(f"\n## A commit's snapshot against the model's own step, in one process (--model {args.model})\n")
        snapshot_cost(args.steps * 2)
    if "recovery" in parts:
        print("\n## Recovery after kill -9 of a worker and its nanny\n")
        recovery(args.trials, args.steps)
    if "stop" in parts:
        print("\n## Recovery after SIGSTOP of a worker and its nanny (alive, silent)\n")
        recovery(args.trials, args.steps, signal.SIGSTOP)
    print(f"\ntotal {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
