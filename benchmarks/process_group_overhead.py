"""What the process-group layer adds to an all-reduce, measured inside the same replicas.

One ``MirroredStrategy`` of 2 worker processes; inside the replicas, blocks
of all-reduces of one float32 array (4 KiB: the latency lane; 64 MiB: the
packed engines) are timed with ``time.perf_counter`` through three paths,
in alternating blocks (ABC, CBA, ...) so that the noise of a shared machine
hits all three alike:

* ``communicator``: ``Communicator.all_reduce`` called directly, the path
  ``ReplicaContext.all_reduce`` took before the process group existed;
* ``context-before``: ``ReplicaContext.all_reduce`` as it was before the
  process group (its method body over the bound communicator method);
* ``context``: ``ReplicaContext.all_reduce`` (the group's inline all-reduce:
  drain check, lock or owner check, communicator);
* ``async``: ``process_group.all_reduce(..., async_op=True).wait()`` (one
  hand-off to the group's FIFO thread and back).

Each call is timed on its own; the figure is the median over calls of the
slower replica's time (as ``allreduce.py`` does), and its ratio to the
``communicator`` path.

Usage::

    .venv/bin/python benchmarks/process_group_overhead.py [--blocks 30] [--transport shm]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import dask
import numpy as np
from distributed import Client, LocalCluster

import daskdist as dd

PATHS = ("communicator", "context-before", "context", "async")


class _ContextBefore:
    """``ReplicaContext.all_reduce`` as it was before the process group: a bound communicator method."""

    def __init__(self, communicator):
        self._all_reduce = communicator.all_reduce

    def all_reduce(self, reduce_op, value, options=None):
        all_reduce = self._all_reduce
        if all_reduce is None:
            raise RuntimeError("unbound")
        return all_reduce(reduce_op, value, options)


def _measure(sizes: list[int], blocks: int) -> dict:
    """Inside a replica: {size: {path: [seconds of each call]}}."""
    ctx = dd.get_replica_context()
    group = ctx.process_group
    communicator = ctx._runtime.communicator  # the pre-process-group path, for comparison only
    before = _ContextBefore(communicator)
    calls = {
        "communicator": lambda x: communicator.all_reduce("SUM", x),
        "context-before": lambda x: before.all_reduce("SUM", x),
        "context": lambda x: ctx.all_reduce("SUM", x),
        "async": lambda x: group.all_reduce("SUM", x, async_op=True).wait(),
    }
    out: dict = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        per_block = 200 if nbytes <= 65536 else 3
        for path in PATHS:  # warm-up (lane plans, buffers)
            for _ in range(3):
                calls[path](x)
        times: dict = {path: [] for path in PATHS}
        for block in range(blocks):
            order = PATHS if block % 2 == 0 else PATHS[::-1]
            for path in order:
                ctx.barrier()
                call = calls[path]
                spent = times[path]
                for _ in range(per_block):
                    start = time.perf_counter()
                    call(x)
                    spent.append(time.perf_counter() - start)
        out[nbytes] = times
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 64 << 20])
    args = parser.parse_args(argv)
    with dask.config.set({"daskdist.collective.transport": args.transport}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                         silence_logs=logging.ERROR) as cluster, Client(cluster) as client, \
            dd.MirroredStrategy(client=client) as strategy:
        results = strategy.experimental_local_results(strategy.run(_measure, args=(args.sizes, args.blocks)))
    print(f"transport {args.transport}, 2 replicas (worker processes), {args.blocks} blocks per path; "
          "median over calls of the slower replica's time")
    print("| size | path | median µs per call | ratio to communicator | ratio to context-before |")
    print("|-----:|------|-------------------:|----------------------:|------------------------:|")
    for nbytes in args.sizes:
        medians = {}
        for path in PATHS:
            slowest = [max(calls) for calls in zip(*(r[nbytes][path] for r in results))]
            medians[path] = statistics.median(slowest)
        for path in PATHS:
            print(f"| {nbytes} | {path} | {medians[path] * 1e6:.1f} | {medians[path] / medians['communicator']:.3f} "
                  f"| {medians[path] / medians['context-before']:.3f} |")


if __name__ == "__main__":
    main()
