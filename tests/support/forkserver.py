"""Worker processes of the tests' own ``LocalCluster`` s forked from one server that imported daskdist already.

A nanny starts its worker process with ``spawn`` by default: a fresh interpreter that imports distributed,
numpy and then daskdist, 1-2 CPU seconds each and 8-10 s of wall time for a cluster of three on two loaded cores.
``distributed.worker.multiprocessing-method: forkserver`` (what Dask's own test suite uses) forks each worker
from one server process that imported those modules once; the workers are still real processes with a real
nanny, which a test may kill. ``forkserver_settings()`` starts that server once per pytest process and returns
the Dask setting to pass while a cluster starts.

The server is started with the environment the session began with plus what Dask's nanny sets before it
spawns a worker (``distributed.nanny.pre-spawn-environ``, ``PYTHONHASHSEED``): a forked worker sees the
environment of the server, not of the test that asked, so a test's ``monkeypatch.setenv`` never leaks into
the workers of later tests, and the workers' environment is the one a spawned worker gets.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import threading

import dask

#: What the server imports before it forks workers: what every replica imports, and the frameworks the tests'
#: replicas run (torch, and Keras 3 on torch: 4-5 CPU seconds a worker otherwise). Not JAX: it starts threads
#: at import, which a fork does not carry (its tests run in subprocesses of their own).
PRELOAD = ["distributed", "numpy", "daskdist", "daskdist.keras", "torch", "keras"]

#: The Keras backend of the forked workers (the tests' Keras 3 modules run on torch): set before the server
#: imports keras, since Keras fixes its backend at import.
KERAS_BACKEND = "torch"

_SESSION_ENVIRON = dict(os.environ)  # this module is imported by conftest, before any test runs
_lock = threading.Lock()
_started = False


def _worker_environ() -> dict[str, str]:
    """The session's environment with what the nanny sets before it spawns a worker (distributed/nanny.py)."""
    environ = dict(_SESSION_ENVIRON)
    for key, value in (dask.config.get("distributed.nanny.pre-spawn-environ") or {}).items():
        if value is not None:
            environ.setdefault(key, str(value))
    environ.setdefault("KERAS_BACKEND", KERAS_BACKEND)
    if environ.get("PYTHONHASHSEED") in (None, "0"):
        environ["PYTHONHASHSEED"] = "6640"  # as the nanny does: the same hashes in every worker
    return environ


def forkserver_settings() -> dict[str, str]:
    """The Dask setting under which a nanny forks its worker from the session's server (started here once)."""
    global _started
    settings = {"distributed.worker.multiprocessing-method": "forkserver"}
    with _lock:
        if not _started:
            from distributed.utils import get_mp_context

            with dask.config.set(settings):
                context = get_mp_context()  # distributed sets its own preload list once: ours replaces it
            context.set_forkserver_preload(PRELOAD)
            # only the keys that differ change, for the moment of the start: other threads read os.environ too
            wanted, saved = _worker_environ(), dict(os.environ)
            for key in set(saved) - set(wanted):
                del os.environ[key]
            os.environ.update({k: v for k, v in wanted.items() if saved.get(k) != v})
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                for key in set(wanted) - set(saved):
                    del os.environ[key]
                os.environ.update({k: v for k, v in saved.items() if os.environ.get(k) != v})
            _started = True
    return settings
