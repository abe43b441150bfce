"""Per-call overhead of ``strategy.run`` compared with a plain Dask task round trip.

For each worker count a fresh ``LocalCluster`` of single-threaded worker
processes is started and a ``MirroredStrategy`` (one replica per worker) is
built on it. Then, on the same cluster and in the same process, two things are
timed on the client with ``time.perf_counter``:

* ``strategy.run(trivial)``: send a function that returns ``None`` to every
  replica and collect the ``PerReplica`` result;
* ``client.submit(noop, pure=False).result()``: one task through the
  scheduler to one worker and back.

The two are measured in alternating blocks (ABBA order) so that noise on a
shared machine hits both alike. The figure of merit is the ratio of the
medians, run / submit (the target is <= 0.3; it must not exceed 0.5).

Usage::

    .venv/bin/python benchmarks/run_overhead.py [--calls 200] [--workers 2 4] [--no-step-events]

``--no-step-events`` sets ``daskdist.metrics.log-events`` to false (before the
cluster starts, so the worker processes inherit it): replicas then keep their
step timings locally and do not send them to the scheduler as Dask events.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
from _common import format_table, local_cluster, percentile_ms, print_header


def trivial() -> None:
    """The replica function: does nothing."""
    return None


def noop() -> None:
    """The Dask task: does nothing."""
    return None


def worker_step_events() -> bool:
    """``daskdist.metrics.log-events`` as a worker process sees it (run with ``client.run``)."""
    import daskdist  # noqa: F401  (registers the daskdist defaults)
    from daskdist import config

    return bool(config.get("metrics.log-events"))


def time_calls(call: Callable[[], object], n: int) -> list[float]:
    """Call ``call`` ``n`` times; return each call's wall time in seconds."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def measure(n_workers: int, calls: int, warmup: int, block: int, step_events: bool) -> dict[str, list[float]]:
    """Time ``strategy.run`` and ``client.submit`` round trips on one fresh cluster.

    Returns the lists of times (seconds) under ``"run"`` and ``"submit"``.
    """
    import dask.config

    import daskdist as dd

    with dask.config.set({"daskdist.metrics.log-events": step_events}), local_cluster(n_workers) as client:
        seen = set(client.run(worker_step_events).values())
        if seen != {step_events}:
            raise RuntimeError(f"workers see daskdist.metrics.log-events={seen}, expected {step_events}")
        strategy = dd.MirroredStrategy(client=client)
        try:
            if strategy.num_replicas_in_sync != n_workers:
                raise RuntimeError(f"expected {n_workers} replicas, got {strategy.num_replicas_in_sync}")
            result = strategy.experimental_local_results(strategy.run(trivial))
            if any(r is not None for r in result):
                raise RuntimeError(f"strategy.run(trivial) returned {result!r}")

            def run_once() -> None:
                strategy.run(trivial)

            def submit_once() -> None:
                client.submit(noop, pure=False).result()

            time_calls(run_once, warmup)
            time_calls(submit_once, warmup)
            timings: dict[str, list[float]] = {"run": [], "submit": []}
            order = [("run", run_once), ("submit", submit_once)]
            done = 0
            while done < calls:
                n = min(block, calls - done)
                for name, call in order:
                    timings[name].extend(time_calls(call, n))
                order.reverse()  # ABBA: neither side always goes first
                done += n
        finally:
            strategy.close()
    return timings


def summarize(n_workers: int, result: dict[str, list[float]]) -> list[str]:
    """One table row: medians, p90s and the run/submit ratio of medians."""
    run, submit = result["run"], result["submit"]
    run_med, submit_med = percentile_ms(run, 50), percentile_ms(submit, 50)
    return [
        str(n_workers),
        str(len(run)),
        f"{run_med:.3f}",
        f"{percentile_ms(run, 90):.3f}",
        f"{submit_med:.3f}",
        f"{percentile_ms(submit, 90):.3f}",
        f"{run_med / submit_med:.3f}",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each kind per cluster (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls of each kind first (default 20)")
    parser.add_argument("--block", type=int, default=10, help="calls per alternating block (default 10)")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[2, 4], help="worker counts, one fresh cluster each (default 2 4)"
    )
    parser.add_argument(
        "--no-step-events",
        action="store_true",
        help="set daskdist.metrics.log-events=false: replicas do not send step timings to the scheduler",
    )
    args = parser.parse_args(argv)
    if args.calls < 1 or args.block < 1 or args.warmup < 0 or any(w < 1 for w in args.workers):
        parser.error("--calls, --block and --workers must be positive, --warmup non-negative")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for each worker count and print the table."""
    args = parse_args(argv)
    print_header("strategy.run(trivial) vs client.submit(noop).result() round trip, client-side wall time")
    step_events = not args.no_step_events
    print(f"daskdist.metrics.log-events: {str(step_events).lower()}  calls: {args.calls}  warm-up: {args.warmup}  "
          f"block: {args.block}\n", flush=True)
    rows = []
    for n_workers in args.workers:
        start = time.perf_counter()
        result = measure(n_workers, args.calls, args.warmup, args.block, step_events)
        rows.append(summarize(n_workers, result))
        print(f"workers={n_workers}: done in {time.perf_counter() - start:.1f} s", flush=True)
    print()
    print(
        format_table(
            ["workers", "calls", "run median ms", "run p90 ms", "submit median ms", "submit p90 ms",
             "ratio run/submit"],
            rows,
        )
    )
    ratios = [float(r[-1]) for r in rows]
    print()
    print(f"ratio of medians run/submit: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(target <= 0.3, limit 0.5): {'OK' if max(ratios) <= 0.5 else 'ABOVE LIMIT'}")


if __name__ == "__main__":
    main()
