"""Async all-reduces in flight together across two namespace hosts: ``daskdist.collective.async-window`` 1 against N.

Two namespace hosts with one Dask worker each (``tests/netns.py``; root and
iproute2), a ``MultiWorkerMirroredStrategy`` over both. Each step issues
``--in-flight`` async SUM all-reduces of ``--size`` bytes on the replica's
process group (as DDP issues its buckets) and waits for all of them; the
figure is the median step (slowest rank). Every window of ``--windows`` runs
in every round, the order rotated round by round, at each of ``--rates``.

Usage (as root), one line that prints the whole table::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/multihost_window.py [--windows 1 2 4] [--sizes 4MiB 16MiB]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _common import format_table, namespace_cluster, print_header  # noqa: E402
from peers._base import format_size, parse_size  # noqa: E402


def _steps(size: int, in_flight: int, steps: int) -> dict[str, Any]:
    """Replica function: ``steps`` times, ``in_flight`` async all-reduces of ``size`` bytes then wait for all."""
    import daskdist as dd

    group = dd.get_replica_context().process_group
    values = [np.full(size // 4, float(i), np.float32) for i in range(in_flight)]
    for _ in range(2):
        for work in [group.all_reduce("SUM", v, async_op=True) for v in values]:
            work.wait()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        works = [group.all_reduce("SUM", v, async_op=True) for v in values]
        results = [work.wait() for work in works]
        times.append(time.perf_counter() - start)
    assert all(float(r[0]) == 2 * i for i, r in enumerate(results))
    return {"median": statistics.median(times)}


def main() -> None:
    import dask

    import daskdist as dd

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[1 << 20, 16 << 20])
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit"])
    args = parser.parse_args()
    print_header("Async all-reduces in flight together across 2 namespace hosts, by async window")
    rows = []
    with namespace_cluster(2, 1, rate=args.rates[0]) as (hosts, client), \
            dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        for rate in args.rates:
            hosts.shape(rate)
            for size in args.sizes:
                times: dict[int, list[float]] = {w: [] for w in args.windows}
                loads = []
                for r in range(args.rounds):
                    order = args.windows[r % len(args.windows):] + args.windows[:r % len(args.windows)]
                    for window in order:
                        loads.append(os.getloadavg()[0])
                        with dask.config.set({"daskdist.collective.async-window": window}):
                            out = strategy.experimental_local_results(
                                strategy.run(_steps, args=(size, args.in_flight, args.steps)))
                        times[window].append(max(o["median"] for o in out))
                base = statistics.median(times[args.windows[0]])
                for window in args.windows:
                    rows.append([rate, format_size(size), args.in_flight, window,
                                 ", ".join(f"{t * 1e3:.1f}" for t in times[window]),
                                 f"{base / statistics.median(times[window]):.2f}",
                                 f"{min(loads):.1f}-{max(loads):.1f}"])
    print(format_table(["link", "size", "in flight", "window", "step ms (rounds)",
                        f"speed-up over window {args.windows[0]}", "load"], rows))


if __name__ == "__main__":
    main()
