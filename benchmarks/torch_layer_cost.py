"""What the torch layer adds to a call: ``dist.*`` on the ``daskdist`` backend against ``collective.ProcessGroup``.

One ``MirroredStrategy`` of 2 worker processes; inside the replicas, the same
4 KiB float32 all-reduce (the latency lane) and broadcast are timed call by
call through:

* ``group``: the replica's ``collective.ProcessGroup`` called directly
  (``all_reduce(..., in_place=True)``, ``broadcast``);
* ``torch``: ``torch.distributed`` on the default group
  (``ProcessGroupDaskdist`` over that same group);
* the ``async`` variants: ``dist.all_reduce(async_op=True).wait()`` (inline
  mode: torch's ``DaskdistWork`` over a completed ``collective.Work``) against
  the group's call wrapped in a completed ``collective.Work``.

Blocks of calls alternate between the arms (ABAB..., then reversed) so the
noise of a shared machine hits all alike; each call starts after a barrier;
the figure is the median over calls of the slower replica's time, and the
difference torch - group is what the torch layer adds. The 1-minute load
average is printed with the table.

Usage::

    .venv/bin/python benchmarks/torch_layer_cost.py [--blocks 20] [--calls 200]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import dask
import numpy as np
from distributed import Client, LocalCluster

import daskdist as dd
from daskdist.collective.work import Work

ARMS = ("group all_reduce", "torch all_reduce", "group all_reduce async", "torch all_reduce async",
        "group broadcast", "torch broadcast")


def _measure(blocks: int, calls: int, nbytes: int) -> dict[str, list[float]]:
    """Inside a replica: {arm: [seconds of each call]}."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dd.plugins.torch.init_process_group()
    ctx = dd.get_replica_context()
    group = ctx.process_group
    tensor = torch.zeros(nbytes // 4)  # zeros: repeated sums stay finite
    array = tensor.numpy()
    arms = {
        "group all_reduce": lambda: group.all_reduce("SUM", array, in_place=True),
        "torch all_reduce": lambda: dist.all_reduce(tensor),
        # what torch's inline async work runs underneath: the call, in a completed collective.Work
        "group all_reduce async": lambda: Work.completed(group.all_reduce("SUM", array, in_place=True),
                                                         "all_reduce").wait(),
        "torch all_reduce async": lambda: dist.all_reduce(tensor, async_op=True).wait(),
        "group broadcast": lambda: group.broadcast(array, 0),
        "torch broadcast": lambda: dist.broadcast(tensor, 0),
    }
    for call in arms.values():  # warm-up: lane plans, buffers
        for _ in range(20):
            call()
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for block in range(blocks):
        for arm in (ARMS if block % 2 == 0 else ARMS[::-1]):
            call = arms[arm]
            for _ in range(calls):
                group.barrier()
                start = time.perf_counter()
                call()
                times[arm].append(time.perf_counter() - start)
    return times


def main(blocks: int, calls: int, nbytes: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    with dask.config.set({"daskdist.torch.comm-thread": False}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                         silence_logs=logging.ERROR) as cluster, Client(cluster) as client, \
            dd.MirroredStrategy(client=client) as strategy:
        load = os.getloadavg()
        per_replica = strategy.experimental_local_results(strategy.run(_measure, args=(blocks, calls, nbytes)))
        load_after = os.getloadavg()
    slower = {arm: np.max([r[arm] for r in per_replica], axis=0) for arm in ARMS}
    median = {arm: statistics.median(slower[arm]) * 1e6 for arm in ARMS}
    print(f"{nbytes} bytes float32, 2 replicas (worker processes), {blocks} blocks x {calls} calls per arm; "
          f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after {load_after[0]:.2f}")
    print("| call | collective.ProcessGroup us | torch.distributed us | added by the torch layer us |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("all_reduce", "all_reduce async", "broadcast"):
        group, torch_ = median[f"group {name}"], median[f"torch {name}"]
        print(f"| {name} | {group:.1f} | {torch_:.1f} | {torch_ - group:+.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=4096)
    args = parser.parse_args()
    main(args.blocks, args.calls, args.bytes)
