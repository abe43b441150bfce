"""All-reduce latency and bus bandwidth: daskdist collectives vs a naive Dask-task all-reduce.

For each replica count a fresh ``LocalCluster`` of single-threaded worker
processes is started, with one ``MirroredStrategy`` replica per worker. For
each message size (float32, ``ReduceOp.SUM``) two things are measured on that
same cluster, in alternating blocks (ABBA order) so that noise on a shared
machine hits both alike:

* **daskdist**: ``ReplicaContext.all_reduce`` timed *inside* the replicas
  with ``time.perf_counter``; each iteration's time is the maximum over the
  replicas, the figure is the median over iterations. Each block starts with
  one untimed all-reduce so that the replicas enter the timed loop together.
* **naive Dask**: each worker holds its array as a pinned future; one round
  is a task on worker 0 that sums the N arrays (Dask gathers them there),
  then N tasks, one pinned to each worker, that take the sum (Dask copies it
  to every worker); the client waits for all N. Time per round is measured
  on the client; the figure is the median over rounds.

Bus bandwidth follows the NCCL convention: ``2 (n - 1) / n * bytes / time``.

Usage::

    .venv/bin/python benchmarks/allreduce.py [--sizes 4KiB 256KiB 4MiB 64MiB] [--replicas 2 4] [--quick]
        [--transport dask]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time

import numpy as np
from _common import (
    add_transport_option,
    check_worker_settings,
    config_overrides,
    format_table,
    local_cluster,
    print_header,
    settings_line,
)

DEFAULT_SIZES = ["4KiB", "256KiB", "4MiB", "64MiB"]
DEFAULT_REPLICAS = [2, 4]
QUICK_SIZES = ["4KiB", "4MiB"]
QUICK_REPLICAS = [2]

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


# -- sizes and figures --------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"4KiB"`` -> 4096. Binary (KiB, MiB, GiB) and decimal (KB, MB, GB) units, or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 4KiB, 64MiB)")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be a positive multiple of 4 bytes (float32)")
    return nbytes


def format_size(nbytes: int) -> str:
    """4096 -> ``"4 KiB"`` (exact binary units where possible)."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def default_iterations(nbytes: int) -> int:
    """Timed iterations per size: many for small messages, few for large ones."""
    if nbytes <= 256 * 2**10:
        return 50
    if nbytes <= 4 * 2**20:
        return 20
    return 5


def bus_bandwidth(nbytes: int, n: int, seconds: float) -> float:
    """NCCL's bus bandwidth of an all-reduce, in GB/s (1e9 bytes per second)."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def algorithm_name(nbytes: int, implementation: str) -> str:
    """Which algorithm daskdist uses for a message of ``nbytes`` (AUTO: direct at or below the threshold)."""
    from daskdist import config

    if implementation == "ring":
        return "ring"
    return "direct" if nbytes <= int(config.get("collective.small-message-bytes")) else "ring"


# -- functions that run on the workers ------------------------------------------------


def replica_allreduce(nelems: int, iterations: int, implementation: str) -> np.ndarray:
    """Replica function: ``iterations`` timed SUM all-reduces of ``nelems`` float32 ones.

    Returns the time of each iteration in seconds. Raises if a result is not
    ``num_replicas`` everywhere.
    """
    import daskdist as dd

    ctx = dd.get_replica_context()
    options = None
    if implementation == "ring":
        options = dd.CommunicationOptions(implementation=dd.CommunicationImplementation.RING)
    expected = float(ctx.num_replicas_in_sync)
    x = np.ones(nelems, np.float32)
    result = ctx.all_reduce(dd.ReduceOp.SUM, x, options=options)  # untimed: the replicas leave it together
    times = np.empty(iterations)
    for i in range(iterations):
        start = time.perf_counter()
        result = ctx.all_reduce(dd.ReduceOp.SUM, x, options=options)
        times[i] = time.perf_counter() - start
    for value in (result[0], result[-1], result[nelems // 2]):
        if value != expected:
            raise AssertionError(f"all_reduce gave {value}, expected {expected}")
    return times


def make_array(nelems: int) -> np.ndarray:
    """Naive approach: one worker's input, ``nelems`` float32 ones."""
    return np.ones(nelems, np.float32)


def sum_arrays(*arrays: np.ndarray) -> np.ndarray:
    """Naive approach: the reduction task (Dask has gathered every input on its worker)."""
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return total


def take(total: np.ndarray) -> np.ndarray:
    """Naive approach: a task pinned to one worker whose input is the sum (Dask copies it there)."""
    return total


def first_last(x: np.ndarray) -> tuple[float, float]:
    """Naive approach: check the result where it lies."""
    return float(x[0]), float(x[-1])


# -- measurement ------------------------------------------------------------------------


def daskdist_block(strategy: object, nelems: int, iterations: int, implementation: str) -> np.ndarray:
    """One ``strategy.run`` of ``iterations`` all-reduces; per iteration, the slowest replica's time."""
    per_replica = strategy.run(replica_allreduce, args=(nelems, iterations, implementation))
    times = np.stack(strategy.experimental_local_results(per_replica))
    return times.max(axis=0)


def naive_block(client: object, inputs: list, addresses: list[str], rounds: int) -> list[float]:
    """``rounds`` naive all-reduce rounds (sum task on worker 0, then one pinned copy task per worker)."""
    from distributed import wait

    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        total = client.submit(sum_arrays, *inputs, workers=[addresses[0]], pure=False)
        outs = [client.submit(take, total, workers=[a], pure=False) for a in addresses]
        wait(outs)
        times.append(time.perf_counter() - start)
        for f in outs:
            if f.status != "finished":
                raise RuntimeError(f"naive all-reduce task failed: {f.exception()!r}")
        del total, outs
    return times


def check_naive(client: object, inputs: list, addresses: list[str]) -> None:
    """Run one naive round and check the sum on every worker."""
    total = client.submit(sum_arrays, *inputs, workers=[addresses[0]], pure=False)
    outs = [client.submit(take, total, workers=[a], pure=False) for a in addresses]
    checks = client.gather([client.submit(first_last, o, workers=[a], pure=False) for o, a in zip(outs, addresses)])
    expected = float(len(addresses))
    if any(c != (expected, expected) for c in checks):
        raise AssertionError(f"naive all-reduce gave {checks}, expected {expected}")


def measure_size(client: object, strategy: object, nbytes: int, iterations: int, blocks: int,
                 implementation: str) -> dict:
    """Both approaches at one size, alternating blocks; returns medians in seconds and iteration counts."""
    nelems = nbytes // 4
    addresses = list(strategy.extended.worker_addresses)
    inputs = [client.submit(make_array, nelems, workers=[a], pure=False) for a in addresses]
    client.gather([client.submit(first_last, x, workers=[a], pure=False) for x, a in zip(inputs, addresses)])
    try:
        check_naive(client, inputs, addresses)
        warmup = max(1, min(3, iterations))
        daskdist_block(strategy, nelems, warmup, implementation)
        naive_block(client, inputs, addresses, warmup)

        per_block = math.ceil(iterations / blocks)
        dd_times: list[float] = []
        naive_times: list[float] = []
        first_daskdist = True
        while len(dd_times) < iterations:
            n = min(per_block, iterations - len(dd_times))
            if first_daskdist:
                dd_times.extend(daskdist_block(strategy, nelems, n, implementation))
                naive_times.extend(naive_block(client, inputs, addresses, n))
            else:
                naive_times.extend(naive_block(client, inputs, addresses, n))
                dd_times.extend(daskdist_block(strategy, nelems, n, implementation))
            first_daskdist = not first_daskdist
    finally:
        client.cancel(inputs)
        del inputs
    return {
        "iterations": len(dd_times),
        "daskdist": float(np.median(dd_times)),
        "naive": float(np.median(naive_times)),
    }


def measure_replicas(n_replicas: int, sizes: list[int], blocks: int, implementation: str) -> list[dict]:
    """Every size on one fresh cluster of ``n_replicas`` workers; the cluster is closed before returning."""
    import daskdist as dd

    results = []
    with local_cluster(n_replicas) as client:
        strategy = dd.MirroredStrategy(client=client)
        try:
            check_worker_settings(client)
            if strategy.num_replicas_in_sync != n_replicas:
                raise RuntimeError(f"expected {n_replicas} replicas, got {strategy.num_replicas_in_sync}")
            for nbytes in sizes:
                start = time.perf_counter()
                r = measure_size(client, strategy, nbytes, default_iterations(nbytes), blocks, implementation)
                r.update(replicas=n_replicas, nbytes=nbytes, algorithm=algorithm_name(nbytes, implementation))
                results.append(r)
                print(
                    f"replicas={n_replicas} size={format_size(nbytes)}: daskdist {r['daskdist'] * 1e3:.3f} ms, "
                    f"naive {r['naive'] * 1e3:.3f} ms ({time.perf_counter() - start:.1f} s)",
                    flush=True,
                )
        finally:
            strategy.close()
    return results


def table(results: list[dict]) -> str:
    """The Markdown table of one replica count."""
    rows = []
    for r in results:
        n, nbytes = r["replicas"], r["nbytes"]
        rows.append([
            format_size(nbytes),
            r["algorithm"],
            str(r["iterations"]),
            f"{r['daskdist'] * 1e3:.3f}",
            f"{bus_bandwidth(nbytes, n, r['daskdist']):.3g}",
            f"{r['naive'] * 1e3:.3f}",
            f"{bus_bandwidth(nbytes, n, r['naive']):.3g}",
            f"{r['naive'] / r['daskdist']:.2f}",
        ])
    return format_table(
        ["size", "algorithm", "iters", "daskdist ms", "daskdist busbw GB/s", "naive ms", "naive busbw GB/s",
         "speedup naive/daskdist"],
        rows,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                        help=f"message sizes (default {' '.join(DEFAULT_SIZES)})")
    parser.add_argument("--replicas", nargs="+", type=int, default=None,
                        help=f"replica counts, one fresh cluster each (default {' '.join(map(str, DEFAULT_REPLICAS))})")
    parser.add_argument("--quick", action="store_true",
                        help=f"sizes {' '.join(QUICK_SIZES)} and {QUICK_REPLICAS[0]} replicas "
                             "(--sizes / --replicas still override)")
    parser.add_argument("--blocks", type=int, default=5,
                        help="alternating blocks the iterations of each size are split into (default 5)")
    parser.add_argument("--implementation", choices=["auto", "ring"], default="auto",
                        help="daskdist CommunicationImplementation: auto (direct <= 64 KiB, else ring) or ring")
    add_transport_option(parser)
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = [parse_size(s) for s in (QUICK_SIZES if args.quick else DEFAULT_SIZES)]
    if args.replicas is None:
        args.replicas = list(QUICK_REPLICAS if args.quick else DEFAULT_REPLICAS)
    if any(n < 2 for n in args.replicas) or args.blocks < 1:
        parser.error("--replicas must be at least 2 and --blocks positive")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run every (replicas, size) configuration and print one table per replica count."""
    import dask.config

    args = parse_args(argv)
    print_header("float32 SUM all-reduce: daskdist (timed in the replicas) vs naive Dask tasks (timed on the client)")
    tables = []
    # Set before any cluster starts: the worker processes inherit the client's dask config.
    with dask.config.set(config_overrides(args.transport)):
        print(settings_line())
        print(f"sizes: {', '.join(format_size(s) for s in args.sizes)}  replicas: {args.replicas}  "
              f"implementation: {args.implementation}  blocks: {args.blocks}  "
              f"iterations: {', '.join(f'{format_size(s)}={default_iterations(s)}' for s in args.sizes)}\n",
              flush=True)
        for n in args.replicas:
            results = measure_replicas(n, args.sizes, args.blocks, args.implementation)
            tables.append((n, table(results)))
    for n, text in tables:
        print(f"\n{n} replicas: {n} worker processes (1 thread each) on {os.cpu_count()} CPUs\n")
        print(text)
    print("\nlatency: median; busbw = 2(n-1)/n * bytes / latency (GB/s = 1e9 B/s); "
          "speedup > 1 means daskdist is faster")


if __name__ == "__main__":
    main()
