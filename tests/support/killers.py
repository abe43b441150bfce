"""Where a test places a kill: at a fault point (``Killer``) or at a step replica 0 reported (``KillAtStep``);
where it places a retirement (``RetireAtStep``) or a worker's arrival (``FreeAtStep``).

All are threads that the ``process_workers`` fixture stops and joins when the test ends, so a watcher
never outlives its test (a late exception in it would fail a later test).

For a kill inside one ``strategy.run`` (a replica held in a long sleep while the others wait for it in a
collective): ``worker_pid``, ``RunInBackground`` (the run in a thread, with what it raised and when),
``wait_for_files`` (the replicas' ready files) and ``lines_of`` (what every survivor wrote when it raised);
``kill_the_awaited_peer`` does all of it for the last rank of three, awaited in an all-reduce.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import dask
import numpy as np

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers
from daskdist.group.scheduler_plugin import EVENT_TOPIC
from daskdist.training.progress import PROGRESS_TOPIC


def worker_pid(client, address: str) -> int:
    """The pid of the worker process at ``address`` (not its nanny's)."""
    return client.run(os.getpid, workers=[address])[address]


class RunInBackground:
    """``strategy.run(fn)`` in a thread; ``error`` is what it raised, ``at`` the monotonic time it returned."""

    def __init__(self, strategy, fn):
        self.error: BaseException | None = None
        self.at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(strategy, fn), daemon=True)
        self.thread.start()

    def _run(self, strategy, fn) -> None:
        try:
            strategy.run(fn)
        except BaseException as e:  # kept for the test to check: the run must raise, not hang
            self.error = e
        self.at = time.monotonic()

    def join(self, timeout: float = 30) -> BaseException | None:
        """Wait for the run; fail the test if it is still running after ``timeout`` s (a hang)."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "strategy.run hung after a worker was killed"
        return self.error


def _record(path) -> dict | None:
    """The JSON record at ``path``; ``None`` while it is missing or still being written (empty or cut short)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def json_records(directory, ranks, wait: float) -> dict[int, dict]:
    """The ``rank-<r>.json`` records the replicas wrote in ``directory``, waiting up to ``wait`` s for all of them.

    A replica writes its record as it raises: one read while it writes finds the file empty (seen under load 30),
    so a record counts once it parses.
    """
    deadline = time.monotonic() + wait
    while True:
        records = {r: _record(directory / f"rank-{r}.json") for r in ranks}
        found = {r: record for r, record in records.items() if record is not None}
        if len(found) == len(ranks) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def wait_for_files(directory, pattern: str, count: int, timeout: float = 120) -> None:
    """Block until ``count`` files match ``pattern`` in ``directory`` (replicas that reached a point)."""
    deadline = time.monotonic() + timeout
    while len(list(directory.glob(pattern))) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(list(directory.glob(pattern)))} of {count} replicas reached {pattern}")
        time.sleep(0.05)


def lines_of(path, count: int, timeout: float = 12) -> list[str]:
    """The lines of ``path`` once it has ``count`` of them, or what it has when ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(path.read_text().splitlines() if path.exists() else []) < count:
        time.sleep(0.1)
    return path.read_text().splitlines() if path.exists() else []


def kill_the_awaited_peer(client, strategy, directory, elements: int, lane_plans: bool = False) -> list[str]:
    """SIGKILL rank 2's worker while ranks 0 and 1 wait for its array in an all-reduce; what each survivor wrote.

    ``strategy`` has three replicas, one per worker process of ``client``. Rank 2 sleeps; ranks 0 and 1
    mark ``directory`` and all-reduce ``elements`` float32 ones (deadline 120 s), so they block inside
    the transport (or the socket lane) until the kill. The run must raise ``ReplicaLostError`` within
    20 s, and both survivors must have raised it within 10 s of the kill. Returns their lines, sorted:
    ``"<rank> ReplicaLostError"``, followed by the number of socket-lane plans the replica holds when
    ``lane_plans``.
    """
    victim = strategy.extended.worker_addresses[2]
    pid = worker_pid(client, victim)
    log = directory / "raised"
    entering = str(directory / "entering-{}")

    def fn():  # a closure, pickled by value: the workers need not import this module
        ctx = dd.get_replica_context()
        if ctx.replica_id_in_sync_group == 2:
            time.sleep(60)
        open(entering.format(ctx.replica_id_in_sync_group), "w").close()
        try:
            ctx.all_reduce("SUM", np.ones(elements, np.float32), dd.CommunicationOptions(timeout_seconds=120))
        except dd.ReplicaLostError as e:
            line = f"{ctx.replica_id_in_sync_group} {type(e).__name__}"
            if lane_plans:
                from daskdist import context

                lane = context.current_runtime().communicator.socket_lane  # None: the lane is off
                line += f" {0 if lane is None else sum(p is not None for p in lane._plans.values())}"
            with open(log, "a") as f:
                f.write(line + "\n")
            raise

    run = RunInBackground(strategy, fn)
    wait_for_files(directory, "entering-*", 2)
    time.sleep(0.5)  # from the marker into the transport's wait (microseconds quiet; a loaded machine's margin)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    error = run.join(20)
    assert isinstance(error, dd.ReplicaLostError), repr(error)
    lines = lines_of(log, 2, timeout=10)
    assert time.monotonic() - killed < 10, lines
    return sorted(lines)


class _Watcher:
    """A daemon thread polling ``_poll`` until it returns True, the deadline passes or ``stop()``."""

    def __init__(self, timeout: float = 120.0, interval: float = 0.02):
        self.record: dict = {}
        self._stopped = threading.Event()
        self._timeout = timeout
        self._interval = interval
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline and not self._stopped.is_set():
            if self._poll():
                return
            self._stopped.wait(self._interval)

    def _poll(self) -> bool:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop polling and join the thread."""
        self._stopped.set()
        self.thread.join(10)


def is_cli_nanny(pid: int) -> bool:
    """Whether ``pid`` is a ``dask worker`` CLI process (a nanny), not this process nor the fork server.

    A worker forked from the session's fork server (``tests/support/processes.py``) has that server as its
    parent, and a ``make_cluster`` worker this process: neither may be killed as a nanny.
    """
    if pid == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(os.path.basename(a) == b"dask" for a in argv) and b"worker" in argv


class Killer(_Watcher):
    """Waits for the paused replica's file (``daskdist.testing.pause-file``), then kills -9 it and its nanny.

    The nanny only where it has one (``is_cli_nanny``): a forked worker's parent is the session's fork server.
    """

    def __init__(self, marker, nanny: bool = True, workers=None):
        super().__init__(interval=0.01)
        self.marker = marker
        self.nanny = nanny  # whether the worker has a nanny (its parent) to kill first
        if workers is not None:
            workers.watch(self)
        self.thread.start()

    def _poll(self) -> bool:
        if not self.marker.exists():
            return False
        try:
            paused = json.loads(self.marker.read_text())
        except json.JSONDecodeError:  # caught mid-write: read it again
            return False
        if self.nanny and is_cli_nanny(paused["ppid"]):
            os.kill(paused["ppid"], signal.SIGKILL)  # the nanny first: nothing restarts the worker
        os.kill(paused["pid"], signal.SIGKILL)
        self.record.update(paused, killed=time.time())
        return True

    def join(self) -> dict:
        self.thread.join(5)
        assert "killed" in self.record, "the replica never reached its fault point"
        return self.record


@contextlib.contextmanager
def killed_at(workers, marker, phase: str, step: int | str, rank: int):
    """Within the block, the replica of ``rank`` pauses at ``phase`` of training step ``step`` (the optimizer's
    iterations: they count on across epochs) and is killed there with its nanny; yields the ``Killer``.

    A fault point (``daskdist.testing.pause-at``), not a sleep: the kill lands at that step however loaded
    the machine is, and no step needs slowing down for it.
    """
    settings = {"daskdist.testing.pause-at": f"{phase}:{step}:{rank}", "daskdist.testing.pause-file": str(marker)}
    with dask.config.set(settings):
        yield Killer(marker, workers=workers)


def reported_step(client, since: float, step: int, epoch: int | None = 0) -> bool:
    """Whether replica 0 reported ``step`` (or later) of ``epoch`` (``None``: any) after ``since``.

    An epoch that had begun reporting before ``since`` and has ended (its ``step: -1`` event) is left out: under
    load an earlier fit's last progress events can reach the scheduler after ``since`` and would otherwise place
    the kill at the start of the next fit.
    """
    events = client.get_events(PROGRESS_TOPIC)
    begun = {(m.get("tag"), m.get("epoch")) for t, m in events if t <= since}
    ended = {(m.get("tag"), m.get("epoch")) for _, m in events if m.get("step") == -1}
    old = begun & ended
    return any(t > since and (m.get("tag"), m.get("epoch")) not in old and epoch in (None, m.get("epoch"))
               and m.get("step", -1) >= step for t, m in events)


def wait_for_step(client, step: int, since: float, epoch: int | None = 0, timeout: float = 120) -> None:
    """Block until replica 0 reported ``step`` of ``epoch`` after ``since``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reported_step(client, since, step, epoch):
            return
        time.sleep(0.02)
    raise AssertionError(f"replica 0 never reported step {step}")


class KillAtStep(_Watcher):
    """Kills ``victim`` (and its nanny) once replica 0 reported ``step`` of ``epoch``.

    ``record["killed"]`` is the monotonic time of the kill. Then turns the workers' slow steps off
    (``ProcessWorkers.slow_steps``): the survivors cannot finish a step without the victim, so the loss
    lands where it was placed and the rest of the run goes at full speed. Stopped with its workers.
    """

    def __init__(self, workers, victim: str, step: int, epoch: int = 0):
        super().__init__()
        self.workers = workers
        self.victim = victim
        self.step = step
        self.epoch = epoch
        self._since = time.time()
        workers.watch(self)
        self.thread.start()

    def _poll(self) -> bool:
        if not reported_step(self.workers.client, self._since, self.step, self.epoch):
            return False
        self.workers.kill(self.victim)
        self.record["killed"] = time.monotonic()
        self.workers.slow_steps(False)
        return True

    def join(self, timeout: float | None = None) -> dict:
        self.thread.join(timeout)
        return self.record


def kill_at_step(workers, victim: str, step: int, epoch: int = 0):
    """A watcher that kills ``victim`` at ``step`` of ``epoch``: returns (thread, record), as the tests use it."""
    watcher = KillAtStep(workers, victim, step, epoch)
    return watcher.thread, watcher.record


async def _close_gracefully(dask_worker) -> None:
    await dask_worker.close_gracefully(reason="worker-lifetime-reached")


class RetireAtStep(_Watcher):
    """Retires ``victim`` once replica 0 reported ``step`` of ``epoch``, then waits until the scheduler no longer
    lists it and turns the workers' slow steps off (``ProcessWorkers.slow_steps``): it has left, the rest of the
    run needs no slowing.

    ``how``: ``"retire_workers"`` (Dask's ``Client.retire_workers``, the worker closed; ``record["answer"]`` is
    its answer) or ``"lifetime"`` (what a worker's ``lifetime`` calls when reached: its graceful close, not
    waited for; ``record["answer"]`` is ``"asked"``). Stopped with its workers; ``join`` says it retired.
    """

    def __init__(self, workers, victim: str, step: int, how: str = "retire_workers", epoch: int = 0):
        if how not in ("retire_workers", "lifetime"):
            raise ValueError(f"how must be 'retire_workers' or 'lifetime', got {how!r}")
        super().__init__()
        self.workers, self.victim, self.step, self.how, self.epoch = workers, victim, step, how, epoch
        self._since = time.time()
        workers.watch(self)
        self.thread.start()

    def _poll(self) -> bool:
        client = self.workers.client
        if not reported_step(client, self._since, self.step, self.epoch):
            return False
        if self.how == "retire_workers":
            self.record["answer"] = client.retire_workers(workers=[self.victim], close_workers=True)
        else:
            client.run(_close_gracefully, workers=[self.victim], wait=False)
            self.record["answer"] = "asked"
        deadline = time.monotonic() + 60
        while self.victim in scheduler_workers(client) and time.monotonic() < deadline:
            if self._stopped.wait(0.05):
                break
        self.workers.slow_steps(False)
        return True

    def join(self, timeout: float = 60) -> dict:
        self.thread.join(timeout)
        assert "answer" in self.record, "the member was never retired"
        return self.record


def _set_status(status: str, dask_worker=None) -> None:
    from distributed.core import Status

    dask_worker.status = Status[status]  # the worker tells the scheduler, as a memory pause does


class FreeAtStep(_Watcher):
    """Holds ``worker`` in Dask's ``paused`` state (busy: not a free worker for elastic admission) until
    replica 0 reported ``step`` of ``epoch``, then lets it run: a worker that becomes free mid-epoch.

    Elastic ``fit`` admits the free workers at its start; this places the arrival after that point. ``workers``
    (the ``ProcessWorkers`` set): once a generation of the group lists ``worker`` (it joined), their slow steps
    are turned off (``ProcessWorkers.slow_steps``): the rest of the run needs no slowing.
    """

    def __init__(self, client, worker: str, step: int, since: float, epoch: int = 0, workers=None):
        super().__init__()
        self.client, self.worker, self.step, self.since, self.epoch = client, worker, step, since, epoch
        self.workers = workers
        client.run(_set_status, "paused", workers=[worker])
        deadline = time.monotonic() + 30
        while scheduler_workers(client)[worker].get("status") != "paused":
            if time.monotonic() > deadline:
                raise AssertionError(f"{worker} was never seen paused by the scheduler")
            time.sleep(0.02)
        self.released = False
        self.thread.start()

    def _poll(self) -> bool:
        if not self.released:
            if not reported_step(self.client, self.since, self.step, self.epoch):
                return False
            self.client.run(_set_status, "running", workers=[self.worker])
            self.released = True
        if self.workers is None:
            return True
        if not any(m.get("action") == "generation" and self.worker in m.get("workers", ())
                   for _, m in self.client.get_events(EVENT_TOPIC)):
            return False
        self.workers.slow_steps(False)
        return True
