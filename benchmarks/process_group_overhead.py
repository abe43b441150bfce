"""What the process-group layer adds to an all-reduce, measured inside the same replicas (issue 20).

One ``MirroredStrategy`` of 2 worker processes; inside the replicas, blocks
of all-reduces of one float32 array (4 KiB: the latency lane; 64 MiB: the
packed engines) are timed with ``time.perf_counter`` through three paths,
in alternating blocks (ABC, CBA, ...) so that the noise of a shared machine
hits all three alike:

* ``communicator``: ``Communicator.all_reduce`` called directly, the path
  ``ReplicaContext.all_reduce`` took before the process group existed;
* ``context``: ``ReplicaContext.all_reduce`` (the group's inline all-reduce:
  drain check, lock, communicator);
* ``async``: ``process_group.all_reduce(..., async_op=True).wait()`` (one
  hand-off to the group's FIFO thread and back).

The figure is the median over blocks of the per-call time of a block (the
slower replica's), and its ratio to the ``communicator`` path.

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

PATHS = ("communicator", "context", "async")


def _measure(sizes: list[int], blocks: int) -> dict:
    """Inside a replica: {size: {path: [seconds per call, one per block]}}."""
    ctx = dd.get_replica_context()
    group = ctx.process_group
    communicator = ctx._runtime.communicator  # the pre-process-group path, for comparison only
    calls = {
        "communicator": lambda x: communicator.all_reduce("SUM", x),
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
                start = time.perf_counter()
                for _ in range(per_block):
                    call(x)
                times[path].append((time.perf_counter() - start) / per_block)
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
    print(f"transport {args.transport}, 2 replicas (worker processes), {args.blocks} blocks per path, "
          "per-call time = the slower replica's block time / calls in the block; median over blocks")
    print("| size | path | median µs per call | ratio to communicator |")
    print("|-----:|------|-------------------:|----------------------:|")
    for nbytes in args.sizes:
        medians = {}
        for path in PATHS:
            slowest = [max(r[nbytes][path][b] for r in results) for b in range(args.blocks)]
            medians[path] = statistics.median(slowest)
        for path in PATHS:
            print(f"| {nbytes} | {path} | {medians[path] * 1e6:.1f} | {medians[path] / medians['communicator']:.3f} |")


if __name__ == "__main__":
    main()
