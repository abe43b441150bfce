"""Real Dask worker processes that a test may kill, forked from the session's fork server.

``ProcessWorkers(n)``: a scheduler in this process and ``n`` worker processes that the test owns, so that a
kill -9 of a worker leaves nothing to replace it, as when a machine goes away. By default each worker is a
plain ``distributed.Worker`` in a process forked from the session's fork server (``tests/support/forkserver.py``),
which imported distributed, daskdist, torch and Keras already: a set of three is up in well under a second,
and has no nanny (nothing restarts a killed worker).

``ProcessWorkers(n, nanny=True)`` starts ``dask worker`` processes through the CLI instead, each with its
nanny, as users start them: for the tests of what a nanny does (it restarts a killed worker under the same
name). Starting one costs seconds (two fresh interpreters per worker): ``WarmPool`` builds the next such set
in a background thread while a test runs. A used set is never handed out again (its workers may be killed,
stopped or tuned). ``DASKDIST_TEST_WARM_POOL=0`` turns the pool off.

Each set has a *slow-steps switch* (``ProcessWorkers.slow_steps``): ``tests.support.models.slow_batch``
sleeps in its workers only while it is on (it starts on). A kill placed at a step turns it off once the
kill landed (``support.killers.KillAtStep``): the rest of the run needs no slowing, the survivors cannot
finish a step without the killed replica.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading

from distributed import Client, LocalCluster

from daskdist.cluster.identity import scheduler_workers
from tests.support import cpu_profile
from tests.support.forkserver import forkserver_settings

logger = logging.getLogger(__name__)

#: The environment variable naming a worker set's slow-steps switch (a file: on while it exists).
SLOW_FILE_ENV = "DASKDIST_TEST_SLOW_FILE"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_forked_worker(scheduler_address: str, name: str, environ: dict[str, str]) -> None:
    """The body of a forked worker process: one ``distributed.Worker`` with one thread until it is closed."""
    import asyncio

    import dask
    from distributed import Worker

    os.environ.update(environ)
    dask.config.set({"distributed.worker.memory.pause": False})
    logging.getLogger("distributed").setLevel(logging.ERROR)  # as the CLI sets' silence_logs

    async def serve() -> None:
        async with Worker(scheduler_address, nthreads=1, name=name, dashboard=False) as worker:
            closing = asyncio.get_running_loop()
            # SIGTERM (ProcessWorkers.close) closes the worker as a nanny would: its plugins tear down
            closing.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(worker.close(reason="SIGTERM")))
            await worker.finished()

    asyncio.run(serve())


class ProcessWorkers:
    """A scheduler in this process and worker processes that tests may kill (forked; or CLI with nannies).

    Parameters
    ----------
    n
        The number of workers.
    nanny
        ``False`` (default): plain workers forked from the session's fork server, no nanny. ``True``:
        ``dask worker`` processes started through the CLI, each with its nanny.
    """

    def __init__(self, n: int, nanny: bool = False):
        self.n = n
        self.nanny = nanny
        self.cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=40)
        self.client = Client(self.cluster, set_as_default=False)
        fd, self.slow_file = tempfile.mkstemp(prefix="daskdist-test-slow-")  # the switch starts on
        os.close(fd)
        # no memory pause: Dask would otherwise resume a worker a test holds paused (support.killers.FreeAtStep)
        self._settings = {"DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False", SLOW_FILE_ENV: self.slow_file}
        self.processes: list = []
        self._watchers: list = []
        try:
            for _ in range(n):
                self.add()
            self.client.wait_for_workers(n, timeout=120)
        except BaseException:
            self.close()
            raise

    def add(self, name: str | None = None) -> None:
        """Start one more worker (with its nanny in a CLI set), named ``name`` (a lost worker's: as
        ``LocalCluster.scale`` names the worker it starts in place of a lost one), else a new name."""
        name = name or f"w{len(self.processes)}"
        if self.nanny:
            env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **self._settings}
            dask = os.path.join(os.path.dirname(sys.executable), "dask")
            command = [dask, "worker", self.cluster.scheduler_address, "--nthreads", "1", "--no-dashboard",
                       "--preload", "tests.support.preload", "--name", name]
            self.processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
            return
        forkserver_settings()  # the session's server, started once
        process = multiprocessing.get_context("forkserver").Process(
            target=_run_forked_worker, args=(self.cluster.scheduler_address, name, self._settings),
            name=f"daskdist-test-worker-{name}", daemon=False)
        process.start()
        self.processes.append(process)

    def alive(self) -> bool:
        """Whether every process started is still running."""
        return all(p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive() for p in self.processes)

    def pids(self, address: str) -> tuple[int, int | None]:
        """(worker pid, nanny pid) of the worker at ``address``; the nanny's is ``None`` in a forked set."""
        pid, ppid = self.client.run(lambda: (os.getpid(), os.getppid()), workers=[address])[address]
        return pid, (ppid if self.nanny else None)

    def kill(self, address: str) -> None:
        """kill -9 the worker at ``address`` (and its nanny, in a CLI set): nothing restarts it."""
        worker, nanny = self.pids(address)
        if nanny is not None:
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
        forked = [p for p in self.processes if not isinstance(p, subprocess.Popen)]
        if forked:  # not this process's children: they report their own CPU seconds
            cpu_profile.note_cluster_cpu(self.client)
        for process in forked:  # each closes its worker (a stopped one is killed below)
            if process.is_alive():
                process.terminate()
        for process in forked:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
        self.client.close()
        self.cluster.close()
        for process in self.processes:
            if isinstance(process, subprocess.Popen):
                if process.poll() is None:
                    process.kill()
                process.wait(10)
        self.slow_steps(False)


class WarmPool:
    """Fresh CLI ``ProcessWorkers`` (with nannies) built ahead in a background thread, one set per size asked for.

    ``expected``: how many sets of each size the session's tests will take (``{n: count}``); a set is built ahead
    only while more are to come (none is built that no test takes: six interpreters' start-up for nothing).
    ``None``: always one ahead.
    """

    def __init__(self, enabled: bool = True, expected: dict[int, int] | None = None):
        self.enabled = enabled
        self._expected = expected
        self._taken: dict[int, int] = {}
        self._lock = threading.Lock()
        self._building: dict[int, threading.Thread] = {}
        self._ready: dict[int, ProcessWorkers] = {}
        self._closed = False

    def take(self, n: int, nanny: bool = False) -> ProcessWorkers:
        """A fresh set of ``n`` workers: a forked set made now, or a CLI set built ahead if there is one."""
        if not nanny:
            return ProcessWorkers(n)  # forked in well under a second: nothing to build ahead
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
            workers = ProcessWorkers(n, nanny=True)
        self._taken[n] = self._taken.get(n, 0) + 1
        if self._expected is None or self._expected.get(n, 0) > self._taken[n]:
            self._build_ahead(n)
        return workers

    def prepare(self, n: int) -> None:
        """Start building a set of ``n`` now, for a test about to take one, unless one is ready or being built."""
        with self._lock:
            if n in self._ready or (n in self._building and self._building[n].is_alive()):
                return
        if self._expected is None or self._expected.get(n, 0) > self._taken.get(n, 0):
            self._build_ahead(n)

    @staticmethod
    def _alive(workers: ProcessWorkers) -> bool:
        return workers.alive() and len(scheduler_workers(workers.client)) == workers.n

    def _build_ahead(self, n: int) -> None:
        if not self.enabled:
            return

        def build() -> None:
            try:
                made = ProcessWorkers(n, nanny=True)
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
