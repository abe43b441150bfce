"""Free a closed group's objects in a garbage collection that ``sys._current_frames()`` starts; print ``listed``.

Dask's profiler calls ``sys._current_frames()`` in every worker's event loop.
On CPython before 3.11.9 (gh-106883) a collection that starts inside that
call and frees a ``threading.local`` deadlocks the interpreter with the GIL
held: this script then never prints. A group on the threaded cluster runs
a few collectives over TCP and closes with the collector off, so its
generation's objects (reference cycles) wait for it; the cluster closes,
and the first collection is made to start inside ``sys._current_frames()``.
"""

from __future__ import annotations

import gc
import logging
import sys

import dask
import numpy as np
from distributed import Client, LocalCluster

import daskdist as dd

CROSS_HOST = {"daskdist.collective.transport": "auto", "daskdist.collective.hosts": "per-worker"}


def fn():
    ctx = dd.get_replica_context()
    total = ctx.all_reduce("SUM", np.ones(3))
    return ctx.broadcast(total, root=0).tolist()


def main() -> None:
    gc.disable()  # the closed generation's reference cycles wait for the collection below
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster, set_as_default=False) as client:
        with dask.config.set(CROSS_HOST), dd.MirroredStrategy(client=client) as strategy:
            results = strategy.experimental_local_results(strategy.run(fn))
            assert all(r == [3.0] * 3 for r in results), results
    gc.set_threshold(1)  # the next allocation collects: the first frame object sys._current_frames() makes
    gc.enable()
    frames = sys._current_frames()
    print("listed", len(frames), flush=True)


if __name__ == "__main__":
    main()
