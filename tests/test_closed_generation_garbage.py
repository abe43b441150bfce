"""A closed group leaves the garbage collector nothing that can freeze the process.

On CPython before 3.11.9 (gh-106883) a collection that starts inside
``sys._current_frames()`` and frees a ``threading.local`` deadlocks the
interpreter with the GIL held: every thread stops, a Python-level timeout
(pytest-timeout's included) never runs. Dask's profiler calls
``sys._current_frames()`` in every worker's event loop every few
milliseconds, and a closed generation's mailbox, transport and communicator
are reference cycles that only the collector frees: so a generation's objects
must hold no ``threading.local``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import dask
import numpy as np
import pytest

import daskdist as dd

SCRIPT = Path(__file__).parent / "scripts" / "collect_in_current_frames.py"
CROSS_HOST = {"daskdist.collective.transport": "auto", "daskdist.collective.hosts": "per-worker"}
_THREAD_LOCAL = type(threading.local())


@pytest.mark.skipif(sys.implementation.name != "cpython" or sys.version_info >= (3, 11, 9),
                    reason="only CPython before 3.11.9 deadlocks when a collection inside sys._current_frames() "
                           "frees a threading.local (gh-106883)")
def test_freeing_a_closed_group_while_the_profiler_lists_frames_does_not_freeze_the_process():
    """The closed group's objects are freed inside ``sys._current_frames()``, as under Dask's profiler."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the process froze: the closed group's objects were freed inside sys._current_frames()")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("listed "), (done.stdout, done.stderr)


def test_a_closed_generation_leaves_no_thread_local_to_the_collector(threaded_client):
    """On any interpreter: what a closed group leaves as reference cycles holds no ``threading.local``."""

    def fn():
        ctx = dd.get_replica_context()
        total = ctx.all_reduce("SUM", np.ones(3))
        return ctx.broadcast(total, root=0).tolist()

    gc.collect()
    flags = gc.get_debug()
    gc.disable()  # the closed generation's cycles wait for the collection below, whatever allocates meanwhile
    try:
        with dask.config.set(CROSS_HOST), dd.MirroredStrategy(client=threaded_client) as strategy:
            results = strategy.experimental_local_results(strategy.run(fn))
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collection frees, to look at it
        gc.collect()
        cycles = list(gc.garbage)
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.enable()
    assert all(r == [3.0] * 3 for r in results), results
    assert len(cycles) > 100  # the generation's objects were there to look at
    held = sorted({f"{type(obj).__qualname__} -> {type(ref).__qualname__}"
                   for obj in cycles for ref in [obj, *gc.get_referents(obj)] if isinstance(ref, _THREAD_LOCAL)})
    del cycles
    assert held == [], held
