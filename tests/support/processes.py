"""Real ``dask worker`` processes (each with its nanny) that a test may kill, and a warm pool of them.

``ProcessWorkers(n)``: a scheduler in this process and ``n`` ``dask worker`` processes started by the
test, so that a kill -9 of a worker and its nanny leaves nothing to replace it, as when a machine goes
away. Starting one costs seconds (two interpreters per worker importing dask, distributed and daskdist):
``WarmPool`` builds the next set in a background thread while a test runs, so a test that asks for ``n``
workers gets fresh, never-used processes that are already up. A used set is never handed out again
(its workers may be killed, stopped or tuned); the pool replaces it with a fresh one.

``DASKDIST_TEST_WARM_POOL=0`` turns the pool off (every set is then started inside its test).

Each set has a *slow-steps switch* (``ProcessWorkers.slow_steps``): ``tests.support.models.slow_batch``
sleeps in its workers only while it is on (it starts on). A kill placed at a step turns it off once the
kill landed (``support.killers.KillAtStep``): the rest of the run needs no slowing, the survivors cannot
finish a step without the killed replica.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading

from distributed import Client, LocalCluster

from daskdist.cluster.identity import scheduler_workers

logger = logging.getLogger(__name__)

#: The environment variable naming a worker set's slow-steps switch (a file: on while it exists).
SLOW_FILE_ENV = "DASKDIST_TEST_SLOW_FILE"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ProcessWorkers:
    """A scheduler in this process and ``dask worker`` processes (nanny + worker) that tests may kill."""

    def __init__(self, n: int):
        self.n = n
        self.cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=40)
        self.client = Client(self.cluster, set_as_default=False)
        fd, self.slow_file = tempfile.mkstemp(prefix="daskdist-test-slow-")  # the switch starts on
        os.close(fd)
        # no memory pause: Dask would otherwise resume a worker a test holds paused (support.killers.FreeAtStep)
        self._env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                     "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False", SLOW_FILE_ENV: self.slow_file}
        dask = os.path.join(os.path.dirname(sys.executable), "dask")
        self._command = [dask, "worker", self.cluster.scheduler_address, "--nthreads", "1", "--no-dashboard",
                         "--preload", "tests.support.preload"]
        self.nannies = [self._start(f"w{i}") for i in range(n)]
        self._watchers: list = []
        try:
            self.client.wait_for_workers(n, timeout=120)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str) -> subprocess.Popen:
        return subprocess.Popen(self._command + ["--name", name], env=self._env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def add(self, name: str | None = None) -> None:
        """Start one more worker (with its nanny), named ``name`` (a lost worker's: as ``LocalCluster.scale``
        names the worker it starts in place of a lost one), else a new name."""
        self.nannies.append(self._start(name or f"w{len(self.nannies)}"))

    def pids(self, address: str) -> tuple[int, int]:
        """(worker pid, nanny pid) of the worker at ``address``."""
        return self.client.run(lambda: (os.getpid(), os.getppid()), workers=[address])[address]

    def kill(self, address: str) -> None:
        """kill -9 the worker at ``address`` and its nanny: nothing restarts it."""
        worker, nanny = self.pids(address)
        os.kill(nanny, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)

    def slow_steps(self, on: bool) -> None:
        """Turn the slow-steps switch of these workers on or off (``tests.support.models.slow_batch``)."""
        if on:
            open(self.slow_file, "a").close()
        elif os.path.exists(self.slow_file):
            os.unlink(self.slow_file)

    def watch(self, watcher) -> None:
        """Stop and join ``watcher`` (anything with ``stop()``) when these workers close."""
        self._watchers.append(watcher)

    def close(self) -> None:
        for watcher in self._watchers:  # before the client closes: no watcher polls a closed client
            watcher.stop()
        self.client.close()
        self.cluster.close()
        for process in self.nannies:
            if process.poll() is None:
                process.kill()
            process.wait(10)
        self.slow_steps(False)


class WarmPool:
    """Fresh ``ProcessWorkers`` built ahead, in a background thread, one set per size asked for before."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._building: dict[int, threading.Thread] = {}
        self._ready: dict[int, ProcessWorkers] = {}
        self._closed = False

    def take(self, n: int) -> ProcessWorkers:
        """A fresh set of ``n`` workers: the one built ahead if there is one, else started now."""
        workers = None
        if self.enabled:
            with self._lock:
                builder = self._building.get(n)
            if builder is not None:
                builder.join()
            with self._lock:
                workers = self._ready.pop(n, None)
        if workers is not None and not self._alive(workers):
            workers.close()
            workers = None
        if workers is None:
            workers = ProcessWorkers(n)
        self._build_ahead(n)
        return workers

    @staticmethod
    def _alive(workers: ProcessWorkers) -> bool:
        return (all(p.poll() is None for p in workers.nannies)
                and len(scheduler_workers(workers.client)) == workers.n)

    def _build_ahead(self, n: int) -> None:
        if not self.enabled:
            return

        def build() -> None:
            try:
                made = ProcessWorkers(n)
            except Exception:  # the next take() starts its own set and shows the error there
                logger.exception("the warm pool could not build %d workers", n)
                return
            with self._lock:
                if self._closed:
                    made.close()
                else:
                    self._ready[n] = made

        thread = threading.Thread(target=build, name=f"warm-pool-{n}", daemon=True)
        with self._lock:
            if self._closed:
                return
            self._building[n] = thread
        thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            builders = list(self._building.values())
        for builder in builders:
            builder.join(150)
        with self._lock:
            ready, self._ready = list(self._ready.values()), {}
        for workers in ready:
            workers.close()


def warm_pool_enabled() -> bool:
    """Whether ``DASKDIST_TEST_WARM_POOL`` leaves the pool on (the default)."""
    return os.environ.get("DASKDIST_TEST_WARM_POOL", "1") not in ("0", "false", "no")
