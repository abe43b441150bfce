"""Per-call overhead of ``strategy.run`` compared with a plain Dask task round trip.

For each worker count a fresh ``LocalCluster`` of single-threaded worker
processes is started and a ``MirroredStrategy`` (one replica per worker) is
built on it. Then, on the same cluster and in the same process, two things are
timed on the client with ``time.perf_counter``:

* ``strategy.run(trivial)``: send a function that returns ``None`` to every
  replica and collect the results;
* ``client.submit(noop, pure=False).result()``: one task through the
  scheduler to one worker and back;
* ``strategy.run(allreduce_step)``: a step with one 4 KiB all-reduce (1024
  float32 summed over the replicas), the issue's figure of the client's
  command path (TensorFlow's in-process ``MirroredStrategy`` does the same
  step in about 0.66 ms on the reference machine);
* the same step through the Dask RPC command path (a second strategy on the
  same workers made with ``daskdist.client.command-channel: dask``): the
  path every command took before the direct channel, for comparison;
* TensorFlow's own in-process ``MirroredStrategy.run`` of the same step with
  as many logical CPU devices (``peers/tf_mirrored_run.py``, a subprocess run
  before and after the cluster's blocks; eager, and inside a ``tf.function``
  as TensorFlow's guides write steps), where ``tensorflow`` is installed
  (the ``bench`` extra; ``--no-tf`` skips it).

The two are measured in alternating blocks (ABBA order) so that noise on a
shared machine hits both alike. The figure of merit is the ratio of the
medians, run / submit (the target is <= 0.3; it must not exceed 0.5).

Usage::

    .venv/bin/python benchmarks/run_overhead.py [--calls 200] [--workers 2 4] [--no-step-events] [--transport dask]

``--no-step-events`` sets ``daskdist.metrics.log-events`` to false (before the
cluster starts, so the worker processes inherit it): replicas then keep their
step timings locally and do not send them to the scheduler as Dask events.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _common import (
    add_transport_option,
    check_worker_settings,
    config_overrides,
    format_table,
    local_cluster,
    percentile_ms,
    print_header,
    settings_line,
)

#: TensorFlow's in-process ``MirroredStrategy.run`` of the 4 KiB all-reduce step on the reference machine.
TF_IN_PROCESS_MS = 0.66


def trivial() -> None:
    """The replica function: does nothing."""
    return None


def allreduce_step() -> None:
    """The replica function of a step: one 4 KiB all-reduce (1024 float32)."""
    import numpy as np

    import daskdist as dd

    dd.get_replica_context().all_reduce(dd.ReduceOp.SUM, np.ones(1024, np.float32))
    return None


def noop() -> None:
    """The Dask task: does nothing."""
    return None


def time_calls(call: Callable[[], object], n: int) -> list[float]:
    """Call ``call`` ``n`` times; return each call's wall time in seconds."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def measure(n_workers: int, calls: int, warmup: int, block: int) -> dict[str, list[float]]:
    """Time ``strategy.run`` and ``client.submit`` round trips on one fresh cluster.

    Returns the lists of times (seconds) under ``"run"`` and ``"submit"``.
    """
    import dask.config

    import daskdist as dd

    with local_cluster(n_workers) as client:
        strategy = dd.MirroredStrategy(client=client)
        with dask.config.set({"daskdist.client.command-channel": "dask"}):
            rpc_strategy = dd.MirroredStrategy(client=client)
        try:
            check_worker_settings(client)
            if strategy.num_replicas_in_sync != n_workers:
                raise RuntimeError(f"expected {n_workers} replicas, got {strategy.num_replicas_in_sync}")
            result = strategy.experimental_local_results(strategy.run(trivial))
            if any(r is not None for r in result):
                raise RuntimeError(f"strategy.run(trivial) returned {result!r}")

            def run_once() -> None:
                strategy.run(trivial)

            def submit_once() -> None:
                client.submit(noop, pure=False).result()

            def step_once() -> None:
                strategy.run(allreduce_step)

            def rpc_step_once() -> None:
                rpc_strategy.run(allreduce_step)

            time_calls(run_once, warmup)
            time_calls(submit_once, warmup)
            time_calls(step_once, warmup)
            time_calls(rpc_step_once, warmup)
            timings: dict[str, list[float]] = {"run": [], "submit": [], "step": [], "rpc_step": []}
            order = [("run", run_once), ("submit", submit_once), ("step", step_once), ("rpc_step", rpc_step_once)]
            done = 0
            while done < calls:
                n = min(block, calls - done)
                for name, call in order:
                    timings[name].extend(time_calls(call, n))
                order.reverse()  # ABBA: neither side always goes first
                done += n
        finally:
            strategy.close()
            rpc_strategy.close()
    return timings


def measure_tensorflow(replicas: int, calls: int, warmup: int) -> dict[str, list[float]] | None:
    """TensorFlow's in-process ``MirroredStrategy.run`` of the step (``peers/tf_mirrored_run.py``); None without TF."""
    script = Path(__file__).resolve().parent / "peers" / "tf_mirrored_run.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--calls", str(calls), "--warmup", str(warmup), "--replicas", str(replicas)],
        capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        print(f"TensorFlow peer unavailable: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(n_workers: int, result: dict[str, list[float]]) -> list[str]:
    """One table row: medians, p90s, the run/submit ratio of medians and the 4 KiB all-reduce step."""
    run, submit, step, rpc_step = result["run"], result["submit"], result["step"], result["rpc_step"]
    run_med, submit_med = percentile_ms(run, 50), percentile_ms(submit, 50)
    return [
        str(n_workers),
        str(len(run)),
        f"{run_med:.3f}",
        f"{percentile_ms(run, 90):.3f}",
        f"{submit_med:.3f}",
        f"{percentile_ms(submit, 90):.3f}",
        f"{run_med / submit_med:.3f}",
        f"{percentile_ms(step, 50):.3f}",
        f"{percentile_ms(step, 90):.3f}",
        f"{percentile_ms(rpc_step, 50):.3f}",
    ]


def verdict(ratio: float, target: float = 0.3, limit: float = 0.5) -> str:
    """How a run/submit ratio compares with the issue's target and limit."""
    if ratio <= target:
        return f"meets the target (<= {target})"
    if ratio <= limit:
        return f"above the target {target}, within the limit {limit}"
    return f"ABOVE THE LIMIT {limit}"


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
    parser.add_argument("--no-tf", dest="tf", action="store_false",
                        help="skip TensorFlow's in-process MirroredStrategy (peers/tf_mirrored_run.py)")
    add_transport_option(parser)
    args = parser.parse_args(argv)
    if args.calls < 1 or args.block < 1 or args.warmup < 0 or any(w < 1 for w in args.workers):
        parser.error("--calls, --block and --workers must be positive, --warmup non-negative")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark for each worker count and print the table."""
    import dask.config

    args = parse_args(argv)
    print_header("strategy.run(trivial) vs client.submit(noop).result() round trip, client-side wall time")
    rows = []
    tf_rows = []
    # Set before any cluster starts: the worker processes inherit the client's dask config.
    with dask.config.set(config_overrides(args.transport, {"metrics.log-events": False} if args.no_step_events else None)):
        print(f"{settings_line()}\ncalls: {args.calls}  warm-up: {args.warmup}  block: {args.block}\n", flush=True)
        for n_workers in args.workers:
            start = time.perf_counter()
            tf_runs = [measure_tensorflow(n_workers, args.calls // 2, args.warmup)] if args.tf else []
            result = measure(n_workers, args.calls, args.warmup, args.block)
            if args.tf:
                tf_runs.append(measure_tensorflow(n_workers, args.calls // 2, args.warmup))
            rows.append(summarize(n_workers, result))
            if args.tf and all(tf_runs):
                eager = [t for run in tf_runs for t in run["eager"]]
                function = [t for run in tf_runs for t in run["function"]]
                step_ms = percentile_ms(result["step"], 50)
                tf_rows.append([str(n_workers), f"{step_ms:.3f}", f"{percentile_ms(function, 50):.3f}",
                                f"{percentile_ms(eager, 50):.3f}",
                                f"{step_ms / percentile_ms(function, 50):.2f}"])
            print(f"workers={n_workers}: done in {time.perf_counter() - start:.1f} s", flush=True)
    print()
    print(
        format_table(
            ["workers", "calls", "run median ms", "run p90 ms", "submit median ms", "submit p90 ms",
             "ratio run/submit", "4 KiB step median ms", "4 KiB step p90 ms", "4 KiB step via Dask RPC median ms"],
            rows,
        )
    )
    if tf_rows:
        print()
        print(format_table(["replicas", "daskdist step median ms", "TF tf.function median ms",
                            "TF eager median ms", "daskdist / TF tf.function"], tf_rows))
    print()
    for row in rows:
        print(f"workers={row[0]}: ratio of medians run/submit {row[6]} -> {verdict(float(row[6]))}")
        print(f"workers={row[0]}: strategy.run of a step with one 4 KiB all-reduce: median {row[7]} ms "
              f"(goal <= {TF_IN_PROCESS_MS} ms, TensorFlow's in-process MirroredStrategy on the reference machine); "
              f"through Dask RPC: {row[9]} ms")


if __name__ == "__main__":
    main()
