"""Cost of daskdist's step metrics: timers plus shipping as Dask events, versus timers only.

Two fresh ``LocalCluster``s of single-threaded worker processes run the same
step (a small all-reduce, as a gradient step of a small model does) through
``strategy.run``: one with ``daskdist.metrics.log-events: true`` (the default:
replicas ship their step timings to the scheduler, which feeds the metrics
store, ``/metrics`` and the dashboard page) and one with it false (timings stay
on the replicas). The step timers themselves always run. Blocks of steps
alternate between the two clusters (ABBA order) so that noise on a shared
machine hits both alike. Reported: median client-side step time of each, and
the ratio on/off (1.00 = free).

Usage::

    .venv/bin/python benchmarks/metrics_overhead.py [--steps 400] [--workers 2] [--bytes 65536]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
from _common import format_table, local_cluster, percentile_ms, print_header


def _step_fn(n: int):
    def step():
        import daskdist as dd

        return dd.get_replica_context().all_reduce("SUM", np.ones(n, dtype=np.float32))

    return step


def _time_block(strategy, step, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        strategy.run(step)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps per setting")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=65536, help="all-reduce payload per step")
    parser.add_argument("--block", type=int, default=50, help="steps per ABBA block")
    args = parser.parse_args()

    import dask.config

    import daskdist as dd

    print_header("step time with step metrics shipped to the scheduler (on) vs kept on the replicas (off)")
    step = _step_fn(max(1, args.bytes // 4))
    with contextlib.ExitStack() as stack:
        strategies = {}
        for name, ship in (("on", True), ("off", False)):
            # set before the cluster starts: the worker processes inherit the client's dask config
            with dask.config.set({"daskdist.metrics.log-events": ship}):
                client = stack.enter_context(local_cluster(args.workers))
                strategy = stack.enter_context(dd.MirroredStrategy(client=client))
            seen = set(client.run(dask.config.get, "daskdist.metrics.log-events").values())
            if seen != {ship}:
                raise RuntimeError(f"workers see daskdist.metrics.log-events={seen}, expected {ship}")
            _time_block(strategy, step, 20)  # warm-up
            strategies[name] = strategy
        times: dict[str, list[float]] = {"on": [], "off": []}
        order = ["on", "off", "off", "on"]
        blocks = max(1, args.steps // args.block)
        for i in range(blocks):
            name = order[i % 4]
            times[name].extend(_time_block(strategies[name], step, args.block))
            other = "off" if name == "on" else "on"
            times[other].extend(_time_block(strategies[other], step, args.block))
    rows = [[name, str(len(t)), f"{percentile_ms(t, 50):.3f}", f"{percentile_ms(t, 90):.3f}"] for name, t in times.items()]
    print(format_table(["log-events", "steps", "median ms", "p90 ms"], rows))
    ratio = np.median(times["on"]) / np.median(times["off"])
    print(f"\nratio on/off (median step time): {ratio:.3f}")


if __name__ == "__main__":
    main()
