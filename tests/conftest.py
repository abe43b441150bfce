"""Shared real clusters for the tests.

``threaded_client``: a LocalCluster whose 3 workers are threads of this
process (fast; real Dask workers, comms and scheduler). ``forked_process_client``: 3 worker
processes, and ``process_client``: 2, each with its nanny, forked from the session's server
(``tests/support/forkserver.py``, which imported daskdist, torch and Keras), started once per session
(pytest process) and shared by the modules, started again for the next module if a test left one with
fewer workers or failed. Crash tests build their own clusters (``make_cluster``, ``process_workers``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

# CPython before 3.11.9 (gh-106883) can freeze a whole process, GIL held, when a garbage collection that starts
# inside ``sys._current_frames()`` frees a ``threading.local`` (or runs a finalizer that lets a thread start or end):
# Dask's worker profiler calls it every 10 ms in every worker, and the threaded clusters' workers live in this
# process. daskdist's own garbage holds no ``threading.local`` (``test_closed_generation_garbage.py``), but other
# libraries' objects can, and a frozen run is a red CI: so the profiler stays off in the suite on those interpreters
# (distributed itself keeps its event-loop profiler off on 3.11 for the same reason). Set before Dask is imported,
# so the worker processes started from here (forked or spawned, and on the namespace hosts) inherit it.
PROFILER_FREEZES = sys.implementation.name == "cpython" and sys.version_info < (3, 11, 9)
if PROFILER_FREEZES:
    os.environ["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"

import dask  # noqa: E402
import pytest  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

from tests.support import cpu_profile  # noqa: E402
from tests.support.forkserver import forkserver_settings  # noqa: E402  (imported before any test: it snapshots the env)

if PROFILER_FREEZES:  # Dask may have been imported before this file (a plugin): its config then missed the variable
    dask.config.set({"distributed.worker.profile.enabled": False})


def _cluster(n_workers: int, processes: bool, **kwargs) -> LocalCluster:
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=processes,
        dashboard_address=":0",
        silence_logs=logging.ERROR,
        **kwargs,
    )


@pytest.fixture(scope="module")
def threaded_client():
    with _cluster(3, processes=False) as cluster, Client(cluster, set_as_default=False) as client:
        yield client


class _SharedCluster:
    """A cluster of ``n`` workers shared by the session's modules; built again where one is missing or stuck."""

    def __init__(self, n_workers: int, processes: bool, forked: bool = False):
        self.n_workers, self.processes, self.forked = n_workers, processes, forked
        self.cluster: LocalCluster | None = None
        self.client: Client | None = None

    def healthy(self) -> Client:
        from daskdist.cluster.identity import scheduler_workers

        if self.client is not None:
            try:
                workers = scheduler_workers(self.client).values()
                if len(workers) == self.n_workers and all(w.get("status") == "running" for w in workers):
                    return self.client
            except OSError:
                pass
            self.close()
        with dask.config.set(forkserver_settings() if self.forked else {}):
            self.cluster = _cluster(self.n_workers, self.processes)
        self.client = Client(self.cluster, set_as_default=False)
        return self.client

    def close(self) -> None:
        if self.client is not None:
            if self.forked:
                cpu_profile.note_cluster_cpu(self.client)
            self.client.close()
            self.client = None
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None


@pytest.fixture(scope="session")
def _shared_process_cluster():
    shared = _SharedCluster(2, processes=True, forked=True)
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def _shared_forked_cluster():
    shared = _SharedCluster(3, processes=True, forked=True)
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def process_client(request, _shared_process_cluster):
    """2 worker processes (with nannies) and a client, shared with the session's other modules.

    Forked from the session's server (``tests/support/forkserver.py``: daskdist, torch and Keras imported
    already), once per session instead of once per module. Tests must leave both workers running and
    unconfigured; a module that needs processes nobody used before defines its own ``process_client``.
    After a module in which a test failed (a timeout may leave replicas running there) the next module
    gets new processes.
    """
    failed = request.session.testsfailed
    yield _shared_process_cluster.healthy()
    if request.session.testsfailed != failed:
        _shared_process_cluster.close()


@pytest.fixture(scope="module")
def forked_process_client(request, _shared_forked_cluster):
    """3 worker processes forked from the session's server (``make_cluster``'s), shared by the session's modules.

    For a framework's real models, whose replicas each hold a whole framework runtime: one replica per
    process, as users run them (``threaded_client`` puts three in this process beside the test's own model).
    The server imported torch and Keras (on torch) already. As with ``process_client``: tests leave the three
    workers running and unconfigured, and a module in which a test failed hands the next one new processes.
    """
    failed = request.session.testsfailed
    yield _shared_forked_cluster.healthy()
    if request.session.testsfailed != failed:
        _shared_forked_cluster.close()


@pytest.fixture(scope="module")
def matrix_client(request):
    """The matrix modules' cluster (``tests/test_matrix_*.py``): ``forked_process_client``, one replica per process;
    in a process whose Keras runs on JAX (``tests/test_keras3_jax.py`` runs the ``keras3-jax`` cases so) 3 workers
    as threads of it, since JAX's runtime threads do not survive the session's fork server."""
    if os.environ.get("KERAS_BACKEND") == "jax":
        with _cluster(3, processes=False) as cluster, Client(cluster, set_as_default=False) as client:
            yield client
        return
    yield request.getfixturevalue("forked_process_client")


@pytest.fixture
def make_cluster():
    """Build a fresh cluster (and client) that the test may break; closed afterwards.

    Its worker processes are forked from the session's server that imported daskdist already
    (``tests/support/forkserver.py``): a cluster of three is up in about a second instead of 8-10 on two
    loaded cores. Each is still a real process with a real nanny, which restarts a killed one the same way
    (the setting holds until the test ends).
    """
    made = []
    settings = contextlib.ExitStack()

    def make(n_workers: int = 2, processes: bool = True, **kwargs) -> Client:
        if processes:
            settings.enter_context(dask.config.set(forkserver_settings()))
        cluster = _cluster(n_workers, processes, **kwargs)
        client = Client(cluster, set_as_default=False)
        made.append((cluster, client))
        return client

    with settings:
        yield make
        for cluster, client in made:
            cpu_profile.note_cluster_cpu(client)
            client.close()
            cluster.close()


class _NetnsHostsOfModule:
    """The module's two namespace hosts, started again before a test if an earlier one broke them.

    A test may kill a worker or cut a link: the next test that asks gets hosts with all 4 workers, whatever
    the order the tests run in.
    """

    def __init__(self, tls: bool = False):
        self.tls = tls
        self.hosts = None
        self.client = None
        self._previous = None

    def healthy(self):
        import signal

        from daskdist.cluster.identity import scheduler_workers
        from tests.netns import start_hosts, unavailable_reason

        if self.client is not None:
            try:
                if len(scheduler_workers(self.client)) == 4:
                    return self.hosts, self.client
            except OSError:
                pass
            self.close()
        reason = unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        self.hosts = start_hosts(2, 2, rate="10gbit", tls=self.tls)

        def on_sigterm(signum, frame):
            self.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        self._previous = signal.signal(signal.SIGTERM, on_sigterm)
        self.client = Client(self.hosts.scheduler_address, set_as_default=False, timeout=120,  # a loaded machine
                             security=self.hosts.security())
        self.client.wait_for_workers(4, timeout=60)
        return self.hosts, self.client

    def close(self):
        import signal

        if self.client is not None:
            self.client.close()
            self.client = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None


@pytest.fixture(scope="module")
def _netns_hosts_of_module():
    holder = _NetnsHostsOfModule()
    yield holder
    holder.close()


@pytest.fixture
def netns_hosts(_netns_hosts_of_module):
    """Two namespace hosts (h1, h2) with 2 Dask workers each, a scheduler on the bridge, and a client.

    Skips with the reason where namespaces cannot be made (not root, no iproute2). Shared by the module's
    tests, and started again if a test left fewer than 4 workers. Everything is removed afterwards, also
    when the test process gets SIGTERM.
    """
    return _netns_hosts_of_module.healthy()


@pytest.fixture(scope="module")
def _netns_tls_hosts_of_module():
    holder = _NetnsHostsOfModule(tls=True)
    yield holder
    holder.close()


@pytest.fixture
def netns_tls_hosts(_netns_tls_hosts_of_module):
    """As ``netns_hosts``, on a ``tls://`` cluster (a temporary self-signed certificate): replicas talk over TLS."""
    pytest.importorskip("cryptography")
    return _netns_tls_hosts_of_module.healthy()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``DASKDIST_TEST_CPU_LOG`` set, each test's wall and CPU seconds go to that file (support.cpu_profile).

    The warm pool starts the nanny workers ``nextitem`` takes meanwhile (``_prepare_nanny_workers_for``).
    """
    _NEXT_ITEM[0] = nextitem
    _prepare_nanny_workers_for(nextitem)
    path = os.environ.get(cpu_profile.LOG_ENV)
    sample = cpu_profile.Sample() if path else None
    try:
        return (yield)
    finally:
        if sample is not None:
            sample.record(path, item.nodeid)


#: How long after its pytest-timeout a test that is still running ends the session through faulthandler.
FROZEN_GRACE_SECONDS = 30


def _pytest_timeout(item) -> float | None:
    """The test's pytest-timeout in seconds (its ``timeout`` marker, else ``--timeout`` or the ini); ``None``: off."""
    import pytest_timeout

    marker = item.get_closest_marker("timeout")
    value = None
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    if value is None:
        value = pytest_timeout.get_env_settings(item.config).timeout
    return float(value) if value else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Faulthandler's watchdog (``faulthandler_timeout``, armed by pytest for every test) re-armed at this test's
    own pytest-timeout plus ``FROZEN_GRACE_SECONDS``.

    pytest-timeout raises from Python, which never runs again in a process frozen with the GIL held (CPython
    before 3.11.9 deadlocks so when a collection inside ``sys._current_frames()``, which Dask's profiler calls,
    frees a ``threading.local``); the watchdog is a C thread: it prints every thread's stack and ends pytest
    (``faulthandler_exit_on_timeout``), so a frozen test names itself soon after its own timeout instead of at
    ``faulthandler_timeout``. A test that fails (pytest-timeout's own failure included) cancels it.
    """
    import faulthandler

    try:  # pytest's own stderr for the dumps (its faulthandler plugin's; not public API: without it, pytest's default)
        from _pytest.faulthandler import fault_handler_stderr_fd_key
    except ImportError:
        return
    timeout = _pytest_timeout(item)
    if timeout is None or fault_handler_stderr_fd_key not in item.config.stash:
        return
    if not float(item.config.getini("faulthandler_timeout") or 0):
        return
    faulthandler.dump_traceback_later(timeout + FROZEN_GRACE_SECONDS, file=item.config.stash[fault_handler_stderr_fd_key],
                                      exit=bool(item.config.getini("faulthandler_exit_on_timeout")))


@pytest.fixture(autouse=True)
def _fake_groups_closed():
    """The in-memory groups a test made are closed after it: their stall watches are threads."""
    yield
    from tests import fakes

    for group in list(fakes.OPEN):
        group.close()


@pytest.fixture(autouse=True)
def _fault_points_disarmed():
    """A test that armed a fault point in this process leaves it disarmed for the next one."""
    yield
    from daskdist import fault_points

    fault_points.ARMED = False


def pytest_collection_modifyitems(config, items):
    """xdist groups (``--dist loadgroup``): every netns test in one group, the rest by module.

    Namespace hosts share the machine's bridge subnets and the stale-run sweep, so they run one at a time;
    a module's tests stay together so its module-scoped clusters start once.
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        netns = item.get_closest_marker("netns") is not None or item.path.name == "test_netns_harness.py"
        item.add_marker(pytest.mark.xdist_group("netns" if netns else item.path.stem))


@pytest.fixture(scope="session")
def warm_pool(request):
    """The session's pool of fresh ``dask worker`` sets with nannies, built ahead in the background for the
    session's tests marked ``nanny_workers(n)`` still to run (each takes ``process_workers(n, nanny=True)``)."""
    from tests.support.processes import WarmPool, warm_pool_enabled

    expected: dict[int, int] = {}
    for item in request.session.items:
        marker = item.get_closest_marker("nanny_workers")
        if marker is not None:
            expected[marker.args[0]] = expected.get(marker.args[0], 0) + 1
    pool = WarmPool(enabled=warm_pool_enabled(), expected=expected)
    _WARM_POOL[:] = [pool]
    yield pool
    _WARM_POOL.clear()
    pool.close()


_WARM_POOL: list = []  # the session's warm pool, once a test asked for it
_NEXT_ITEM: list = [None]  # the test after the running one


def _prepare_nanny_workers_for(item) -> None:
    """Let the warm pool build the set ``item`` takes (marked ``nanny_workers(n)``) while the test before it runs."""
    marker = item.get_closest_marker("nanny_workers") if item is not None else None
    if marker is not None and _WARM_POOL:
        _WARM_POOL[0].prepare(marker.args[0])


@pytest.fixture
def process_workers(warm_pool, request):
    """``make(n, nanny=False)``: ``n`` fresh worker processes and a client; all closed afterwards.

    Forked from the session's fork server without nannies (``nanny=True``: ``dask worker`` processes with
    their nannies, for a test of a restart; ``tests/support/processes.py``). Closing stops the test's kill
    watchers first, then sweeps the shared-memory segments of the replicas killed here (only those whose
    creator is gone).
    """
    from daskdist.collective.transport.shm_orphans import sweep_orphans

    _prepare_nanny_workers_for(_NEXT_ITEM[0])
    made = []

    def make(n: int, nanny: bool = False):
        if nanny and request.node.get_closest_marker("nanny_workers") is None:
            raise AssertionError("a test that takes nanny workers is marked nanny_workers(n) (the warm pool counts them)")
        made.append(warm_pool.take(n, nanny=nanny))
        return made[-1]

    yield make
    for workers in made:
        workers.close()
    sweep_orphans()
