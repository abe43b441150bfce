"""All-reduce latency and bus bandwidth: daskdist's transports vs MPI, gloo, a naive Dask all-reduce and a memcpy bound.

Everything is measured on this machine in one invocation, float32
``ReduceOp.SUM`` all-reduce of an array of ones, for each rank count and
message size. The systems (``--systems``, default all but ``shm``):

* **daskdist** (``auto``, ``shm``, ``socket``, ``dask``: the value of
  ``daskdist.collective.transport`` the strategy is created with; ``shm-slots``:
  ``shm`` with ``daskdist.collective.shm.single-copy-bytes: null``, so large
  messages go through the channel slots, not the single-copy path): a fresh
  ``LocalCluster`` of N single-threaded worker processes with one
  ``MirroredStrategy`` per transport on it (one replica per worker).
  ``ReplicaContext.all_reduce`` is timed *inside* the replicas with
  ``time.perf_counter`` (so the ``strategy.run`` dispatch, once per step, is
  not included). On one host ``auto`` routes every pair of replicas through
  shared memory, the same as ``shm``: the script asks each replica for its
  routes and labels the column ``auto (=shm)`` only when that is so. A
  transport whose strategy fails to start is reported as unavailable.
* **naive Dask** (``naive``): on the same cluster, each worker holds its
  array as a pinned future; one round is a task on worker 0 that sums the N
  arrays (Dask gathers them there), then N tasks, one pinned to each worker,
  that take the sum (Dask copies it to every worker); the client waits for
  all N. Timed on the client (it includes the scheduler round trips, which is
  what an all-reduce built from tasks costs).
* **MPI** (``mpi``, ``peers/mpi_allreduce.py``): ``mpirun -n N`` (Open MPI)
  of mpi4py ranks running ``comm.Allreduce(sendbuf, recvbuf, op=MPI.SUM)`` on
  numpy arrays, timed inside the ranks.
* **gloo** (``gloo``, ``peers/gloo_allreduce.py``): N subprocesses running
  ``torch.distributed.all_reduce`` with the gloo backend on a float32 CPU
  tensor, timed inside the ranks.
* **ideal** (``ideal``): a memcpy-bound ring. ``np.copyto`` of the message
  size is timed in this process between page-aligned buffers (median
  ``t_copy``; small sizes copy many times per sample, 21 samples per round),
  giving the copy bandwidth ``B = bytes / t_copy``. A ring
  all-reduce (reduce-scatter, then all-gather) moves ``2 (n - 1) / n * bytes``
  into every rank, and over shared memory each of those bytes has to be
  copied at least once; with every rank copying at ``B`` at the same time the
  ideal time is ``2 (n - 1) / n * bytes / B = 2 (n - 1) / n * t_copy``, and
  its bus bandwidth is ``B``. It ignores the additions, synchronisation and
  cache effects, and assumes a core per rank: with 4 ranks on 2 cores it is
  optimistic by up to 2x.

Every timed-in-the-ranks system follows the same plan: per size, up to 3
untimed warm-up all-reduces, then blocks of timed all-reduces, each block
starting with one untimed all-reduce so that the ranks enter the timed loop
together; an iteration's time is the maximum over the ranks, the figure is the
median over iterations. Iterations per size: 1000 up to 256 KiB, 100 up to
4 MiB, 10 above (``--iterations`` overrides), the same for every system timed
in the ranks (short blocks would mostly measure the first all-reduces after a
dispatch, while a training step runs many in a row); the naive approach, whose
every round is several scheduler round trips, runs at most
``NAIVE_PER_BLOCK`` rounds per block, followed by a pause of
``NAIVE_SETTLE_SECONDS`` (the workers' event loops are still busy with the
tasks' bookkeeping for a while, and would otherwise compete for the GIL with
the next block's replicas).

The noise of a shared machine is spread over the systems in two ways. On the
cluster, the daskdist transports and the naive approach run in alternating
blocks (order reversed every block). And the whole measurement of a rank count
is split into ``--rounds`` rounds (default 3), each with its share of the
iterations, the phases (memcpy, cluster, MPI, gloo) in reversed order every
other round (ABA); the medians are over the iterations of all rounds, so a
single round disturbed by another job holds only a third of the samples.

Bus bandwidth follows the NCCL convention: ``2 (n - 1) / n * bytes / time``.
Ratios compare the best daskdist transport at each size (lowest median) with
the others: "speedup vs X" = X's latency / daskdist's (> 1: daskdist is
faster; the same as the ratio of bus bandwidths); "fraction of ideal" = ideal
time / daskdist's time. The run ends with the issue's goals, each marked met
or not.

Peers that cannot run (not installed, failed to start) are reported as
``unavailable (reason)``.

Usage::

    .venv/bin/python benchmarks/allreduce.py [--systems auto socket dask mpi gloo naive ideal] [--quick]
        [--sizes 4KiB 256KiB 4MiB 64MiB] [--replicas 2 4] [--rounds 3] [--iterations N]
        [--transport dask] [--mpirun-args "..."]

``--transport NAME`` measures only that daskdist transport (as before the
peers were added); ``--quick``: 4 KiB and 4 MiB, 2 ranks, 1 round.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from _common import (
    add_transport_option,
    check_worker_settings,
    format_table,
    local_cluster,
    print_header,
    settings_line,
)
from peers._base import (
    PeerUnavailable,
    SizePlan,
    bus_bandwidth,
    default_iterations,
    format_size,
    parse_size,
    plan_round,
)

__all__ = ["bus_bandwidth", "default_iterations", "format_size", "main", "parse_size"]

DEFAULT_SIZES = ["4KiB", "256KiB", "4MiB", "64MiB"]
DEFAULT_REPLICAS = [2, 4]
QUICK_SIZES = ["4KiB", "4MiB"]
QUICK_REPLICAS = [2]

DASKDIST_TRANSPORTS = ("auto", "shm", "shm-slots", "socket", "dask", "ucx")
#: dask.config settings (read on the client when the strategy is made) of each daskdist system
DASKDIST_SETTINGS = {
    "auto": {"daskdist.collective.transport": "auto"},
    "shm": {"daskdist.collective.transport": "shm"},
    # shared memory through the channel slots only: no single-copy path (the shm transport before it existed)
    "shm-slots": {"daskdist.collective.transport": "shm", "daskdist.collective.shm.single-copy-bytes": None},
    "socket": {"daskdist.collective.transport": "socket"},
    "dask": {"daskdist.collective.transport": "dask"},
    "ucx": {"daskdist.collective.transport": "ucx"},  # needs ucxx (the ucx extra); else reported unavailable
}
PEERS = ("mpi", "gloo")
SYSTEMS = DASKDIST_TRANSPORTS + PEERS + ("naive", "ideal")
DEFAULT_SYSTEMS = ("auto", "shm-slots", "socket", "dask", "mpi", "gloo", "naive", "ideal")
LABELS = {
    "auto": "daskdist auto",
    "shm": "daskdist shm",
    "shm-slots": "daskdist shm slots only",
    "socket": "daskdist socket",
    "dask": "daskdist dask",
    "ucx": "daskdist ucx",
    "naive": "naive Dask",
    "mpi": "MPI",
    "gloo": "gloo",
    "ideal": "ideal (memcpy)",
}

# The goals ("Fast collectives"), checked at the end.
GOAL_LARGE = 64 * 2**20  # busbw above the best of MPI and gloo; aims: 1.3x MPI, 60 % of the ideal
GOAL_SMALL = 4 * 2**10  # latency within 3x of MPI and at least 10x better than gloo
GOAL_NAIVE = 10.0  # every size at least 10x faster than the naive approach
NAIVE_PER_BLOCK = 4  # naive rounds per block (each is several scheduler round trips: tens of ms)
NAIVE_SETTLE_SECONDS = 0.3  # after a naive block: its task bookkeeping would otherwise share the next block's GIL


def algorithm_name(nbytes: int, implementation: str, ranks: int) -> str:
    """Which algorithm daskdist uses for a message of ``nbytes`` (AUTO: direct at or below the threshold).

    On shared memory (``auto`` on one host) an all-reduce of one array that
    fits the threshold (with two ranks: one channel slot; with more ranks than
    cores: half a slot) takes the latency lane; the other transports use the
    ring above the threshold.
    """
    from dask.utils import parse_bytes

    from daskdist import config

    if implementation == "ring":
        return "ring"
    small = int(config.get("collective.small-message-bytes"))
    if nbytes <= small:
        return "direct"
    slot = parse_bytes(config.get("collective.shm.slot-bytes"))
    if ranks == 2 and nbytes <= slot:
        return "direct on shm, else ring"
    if ranks > len(os.sched_getaffinity(0)) and nbytes <= slot // 2:
        return "direct on shm, else ring"  # more replicas than cores: the lane takes up to half a slot
    single = config.get("collective.shm.single-copy-bytes")
    if single is not None and nbytes >= parse_bytes(single):
        return "single copy on shm, else ring"
    return "ring"


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


def replica_routes() -> str:
    """Replica function: the transports this replica reaches its peers through (daskdist internals; best effort)."""
    try:
        from daskdist.context import current_runtime

        transport = current_runtime().transport
    except Exception as error:  # noqa: BLE001 - only a label depends on it
        return f"unknown ({type(error).__name__})"
    describe = getattr(transport, "describe", None)
    if describe is not None:
        return "+".join(sorted(set(describe().values())))
    return str(getattr(transport, "name", type(transport).__name__))


# -- measurement on the cluster ---------------------------------------------------------


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


def measure_size(client: object, addresses: list[str], strategies: dict[str, object], with_naive: bool,
                 size: SizePlan, implementation: str) -> dict[str, list[float]]:
    """The daskdist transports and the naive approach at one size, in alternating blocks; times by system."""
    nelems = size.nbytes // 4
    inputs: list = []
    if with_naive:
        inputs = [client.submit(make_array, nelems, workers=[a], pure=False) for a in addresses]
        client.gather([client.submit(first_last, x, workers=[a], pure=False) for x, a in zip(inputs, addresses)])
    runners: dict[str, Callable[[int], list[float]]] = {
        name: (lambda k, s=strategy: list(daskdist_block(s, nelems, k, implementation)))
        for name, strategy in strategies.items()
    }
    if with_naive:
        def naive_then_settle(k: int) -> list[float]:
            times = naive_block(client, inputs, addresses, min(k, NAIVE_PER_BLOCK))  # noqa: F821 (run before `del inputs`)
            time.sleep(NAIVE_SETTLE_SECONDS)  # the workers' event loops finish the tasks' bookkeeping
            return times

        runners["naive"] = naive_then_settle
    try:
        if with_naive:
            check_naive(client, inputs, addresses)
        for run in runners.values():
            run(size.warmup)
        times: dict[str, list[float]] = {name: [] for name in runners}
        order = list(runners)
        for count in size.blocks:
            for name in order:
                times[name].extend(runners[name](count))
            order.reverse()  # ABBA: no system always goes first
    finally:
        if inputs:
            client.cancel(inputs)
        del inputs
    return times


def cluster_phase(n: int, plan: list[SizePlan], transports: list[str], with_naive: bool, implementation: str
                  ) -> tuple[dict[str, dict[int, list[float]]], dict[str, str], dict[str, str]]:
    """One fresh cluster of ``n`` workers: a strategy per transport, every size.

    Returns the times by system and size, the routes each transport's replicas
    reported, and why a transport could not be used (its strategy failed to start).
    """
    import dask.config

    import daskdist as dd

    results: dict[str, dict[int, list[float]]] = {"naive": {}} if with_naive else {}
    routes: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    with local_cluster(n) as client:
        strategies: dict[str, object] = {}
        try:
            for transport in transports:
                try:
                    # These settings are read on the client when the strategy is created.
                    with dask.config.set(DASKDIST_SETTINGS[transport]):
                        strategy = dd.MirroredStrategy(client=client)
                except Exception as error:  # noqa: BLE001 - reported in the tables
                    unavailable[transport] = f"strategy failed: {type(error).__name__}: {str(error).splitlines()[0]}"
                    continue
                strategies[transport] = strategy
                results[transport] = {}
                if strategy.num_replicas_in_sync != n:
                    raise RuntimeError(f"expected {n} replicas, got {strategy.num_replicas_in_sync}")
                routes[transport] = ", ".join(sorted(set(strategy.experimental_local_results(
                    strategy.run(replica_routes)))))
            if strategies:
                check_worker_settings(client)
                addresses = list(next(iter(strategies.values())).extended.worker_addresses)
            else:
                addresses = sorted(client.scheduler_info(n_workers=-1)["workers"])
            for size in plan:
                for name, times in measure_size(client, addresses, strategies, with_naive, size,
                                                implementation).items():
                    results[name][size.nbytes] = times
        finally:
            for strategy in strategies.values():
                strategy.close()
    return results, routes, unavailable


# -- the memcpy bound ---------------------------------------------------------------------


def page_aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of float32 starting on a 4 KiB boundary."""
    raw = np.empty(nbytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + nbytes].view(np.float32)


def memcpy_samples(nbytes: int, samples: int = 21, min_sample_bytes: int = 8 * 2**20) -> list[float]:
    """Seconds per ``np.copyto`` of ``nbytes`` (float32), ``samples`` times; small sizes copy repeatedly per sample.

    Source and destination both start on a page boundary: on some x86 CPUs
    (this AMD EPYC VM with glibc 2.36 among them) a ``rep movsb`` copy whose
    destination lies a few bytes past the source modulo 4 KiB runs an order of
    magnitude slower, and where two plain numpy arrays land is up to malloc.
    """
    src = page_aligned(nbytes)
    src[:] = 1.0
    dst = page_aligned(nbytes)
    np.copyto(dst, src)  # touch the pages
    repeat = max(1, min_sample_bytes // nbytes)
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(repeat):
            np.copyto(dst, src)
        times.append((time.perf_counter() - start) / repeat)
    return times


# -- collecting -------------------------------------------------------------------------


@dataclass
class SystemResult:
    """One system at one rank count: times by size (pooled over rounds), or why it is unavailable."""

    times: dict[int, list[float]] = field(default_factory=dict)
    unavailable: str | None = None
    info: str = ""

    def add(self, times: dict[int, list[float]]) -> None:
        for nbytes, values in times.items():
            self.times.setdefault(nbytes, []).extend(values)


def latency(system: str, result: SystemResult, nbytes: int, n: int) -> float | None:
    """Median seconds of ``system`` at ``nbytes`` (for ``ideal``: ``2 (n - 1) / n`` times the median copy)."""
    values = result.times.get(nbytes)
    if result.unavailable is not None or not values:
        return None
    median = float(np.median(values))
    return 2 * (n - 1) / n * median if system == "ideal" else median


_LOAD_READINGS: list[float] = []


def load() -> str:
    """The 1-minute load average, as text (and remembered for the summary)."""
    try:
        value = os.getloadavg()[0]
    except OSError:
        return "?"
    _LOAD_READINGS.append(value)
    return f"{value:.2f}"


def median_ms(system: str, values: list[float], n: int) -> float:
    """Median of ``values`` in ms (for ``ideal``, the copy times: ``2 (n - 1) / n`` times their median)."""
    return latency(system, SystemResult(times={0: values}), 0, n) * 1e3


def measure_replicas(n: int, args: argparse.Namespace) -> dict[str, SystemResult]:
    """Every selected system at ``n`` ranks, in ``args.rounds`` rounds (phases reversed every other round)."""
    from peers import gloo_allreduce, mpi_allreduce

    transports = [s for s in args.systems if s in DASKDIST_TRANSPORTS]
    with_naive = "naive" in args.systems
    results = {s: SystemResult() for s in args.systems}
    phases = (["memcpy"] if "ideal" in args.systems else []) + (["cluster"] if transports or with_naive else [])
    phases += [p for p in PEERS if p in args.systems]
    peer_runners = {
        "mpi": lambda plan: mpi_allreduce.run(n, plan, extra_args=args.mpirun_args),
        "gloo": lambda plan: gloo_allreduce.run(n, plan),
    }
    for round_index in range(args.rounds):
        plan = plan_round(args.sizes, round_index, args.rounds, args.blocks, args.iterations)
        prefix = f"[{n} ranks, round {round_index + 1}/{args.rounds}]"
        for phase in phases if round_index % 2 == 0 else phases[::-1]:
            start, load_before = time.perf_counter(), load()
            this_round: dict[str, dict[int, list[float]]] = {}
            if phase == "memcpy":
                this_round["ideal"] = {size.nbytes: memcpy_samples(size.nbytes) for size in plan}
            elif phase == "cluster":
                usable = [t for t in transports if results[t].unavailable is None]
                this_round, routes, failed = cluster_phase(n, plan, usable, with_naive, args.implementation)
                for transport, seen in routes.items():
                    results[transport].info = f"replica routes: {seen}"
                for transport, reason in failed.items():
                    results[transport].unavailable = reason
                    print(f"{prefix} {LABELS[transport]}: unavailable ({reason})", flush=True)
            elif results[phase].unavailable is None:
                try:
                    outcome = peer_runners[phase](plan)
                except PeerUnavailable as error:
                    results[phase].unavailable = str(error)
                    print(f"{prefix} {LABELS[phase]}: unavailable ({error})", flush=True)
                else:
                    this_round[phase] = outcome["times"]
                    results[phase].info = outcome["info"]
            for name, by_size in this_round.items():
                results[name].add(by_size)
                medians = ", ".join(f"{format_size(nb)} {median_ms(name, v, n):.4g}" for nb, v in by_size.items())
                print(f"{prefix} {LABELS[name]}: {medians} ms", flush=True)
            print(f"{prefix} {phase} phase: {time.perf_counter() - start:.1f} s, load average {load_before} -> {load()}",
                  flush=True)
    return results


# -- reporting ------------------------------------------------------------------------------


def label(system: str, results: dict[str, SystemResult]) -> str:
    """Column label; ``auto`` becomes ``auto (=shm)`` when every replica reached its peers through shared memory."""
    if system == "auto" and results["auto"].info == "replica routes: shm":
        return "daskdist auto (=shm)"
    return LABELS[system]


def best_daskdist(results: dict[str, SystemResult], nbytes: int, n: int) -> tuple[str, float] | None:
    """The daskdist transport with the lowest median latency at ``nbytes``, and that latency."""
    measured = [(latency(t, results[t], nbytes, n), t) for t in DASKDIST_TRANSPORTS if t in results]
    measured = [(seconds, t) for seconds, t in measured if seconds is not None]
    if not measured:
        return None
    seconds, transport = min(measured)
    return transport, seconds


def tables(n: int, results: dict[str, SystemResult], sizes: list[int], args: argparse.Namespace) -> str:
    """Latency, bus bandwidth and ratio tables of one rank count, with the systems' notes."""
    systems = [s for s in SYSTEMS if s in results]
    labels = [label(s, results) for s in systems]

    def cell(system: str, nbytes: int, fmt: Callable[[float], str]) -> str:
        seconds = latency(system, results[system], nbytes, n)
        return "unavailable" if results[system].unavailable else ("-" if seconds is None else fmt(seconds))

    lat_rows, bw_rows, ratio_rows = [], [], []
    for nbytes in sizes:
        iters = str(args.iterations or default_iterations(nbytes))
        lat_rows.append([format_size(nbytes), algorithm_name(nbytes, args.implementation, n), iters]
                        + [cell(s, nbytes, lambda t: f"{t * 1e3:.4g}") for s in systems])
        bw_rows.append([format_size(nbytes)] + [cell(s, nbytes, lambda t: f"{bus_bandwidth(nbytes, n, t):.3g}")  # noqa: B023
                                                for s in systems])
        best = best_daskdist(results, nbytes, n)
        if best is None:
            continue
        transport, mine = best
        row = [format_size(nbytes), label(transport, results).removeprefix("daskdist "),
               f"{bus_bandwidth(nbytes, n, mine):.3g}"]
        for other in ("mpi", "gloo", "naive", "ideal"):
            theirs = latency(other, results[other], nbytes, n) if other in results else None
            if theirs is None:
                row.append("unavailable" if other in results and results[other].unavailable else "-")
            elif other == "ideal":
                row.append(f"{theirs / mine:.1%}")
            else:
                row.append(f"{theirs / mine:.3g}")
        ratio_rows.append(row)
    parts = [
        "latency, median ms:\n",
        format_table(["size", "algorithm", "iters", *labels], lat_rows),
        "\nbus bandwidth, GB/s:\n",
        format_table(["size", *labels], bw_rows),
    ]
    if ratio_rows:
        parts += [
            "\nbest daskdist transport vs the others (speedup = their latency / daskdist's; > 1: daskdist faster):\n",
            format_table(["size", "best daskdist", "busbw GB/s", "speedup vs MPI", "vs gloo", "vs naive",
                          "fraction of ideal"], ratio_rows),
        ]
    notes = [f"* {label(s, results)}: unavailable ({results[s].unavailable})" if results[s].unavailable
             else f"* {label(s, results)}: {results[s].info}" for s in systems if results[s].unavailable or results[s].info]
    if notes:
        parts += ["", *notes]
    return "\n".join(parts)


def goals(n: int, results: dict[str, SystemResult], sizes: list[int]) -> list[str]:
    """The issue's goals at ``n`` ranks, one line each, with the figures behind them."""

    def lat(system: str, nbytes: int) -> float | None:
        return latency(system, results[system], nbytes, n) if system in results else None

    def verdict(ok: bool, goal: bool = True) -> str:
        return ("met" if ok else "NOT MET") if goal else ("reached" if ok else "not reached")

    lines = []
    if GOAL_LARGE in sizes and (best := best_daskdist(results, GOAL_LARGE, n)):
        mine = best[1]
        peers = {p: lat(p, GOAL_LARGE) for p in PEERS}
        peers = {p: t for p, t in peers.items() if t is not None}
        text = f"{n} ranks, 64 MiB, busbw {bus_bandwidth(GOAL_LARGE, n, mine):.3g} GB/s ({label(best[0], results)}): "
        if peers:
            top = min(peers, key=peers.get)
            ratio = peers[top] / mine
            text += f"{ratio:.2f}x the best of MPI/gloo ({LABELS[top]}) -> goal > 1x {verdict(ratio > 1)}"
        else:
            text += "MPI and gloo unavailable -> goal not checked"
        if "mpi" in peers:
            ratio = peers["mpi"] / mine
            text += f"; {ratio:.2f}x MPI -> aim 1.3x {verdict(ratio >= 1.3, goal=False)}"
        if (ideal := lat("ideal", GOAL_LARGE)) is not None:
            text += f"; {ideal / mine:.0%} of the ideal -> aim 60% {verdict(ideal / mine >= 0.6, goal=False)}"
        lines.append(text)
    if GOAL_SMALL in sizes and (best := best_daskdist(results, GOAL_SMALL, n)):
        mine = best[1]
        text = f"{n} ranks, 4 KiB, latency {mine * 1e3:.4g} ms ({label(best[0], results)}): "
        checks = []
        if (mpi := lat("mpi", GOAL_SMALL)) is not None:
            checks.append(f"daskdist's latency / MPI's = {mine / mpi:.3g} -> goal <= 3 {verdict(mine <= 3 * mpi)}")
        else:
            checks.append("MPI unavailable -> goal not checked")
        if (gloo := lat("gloo", GOAL_SMALL)) is not None:
            checks.append(f"gloo's latency / daskdist's = {gloo / mine:.3g} -> goal >= 10 {verdict(gloo >= 10 * mine)}")
        else:
            checks.append("gloo unavailable -> goal not checked")
        lines.append(text + "; ".join(checks))
    speedups = []
    for nbytes in sizes:
        best = best_daskdist(results, nbytes, n)
        naive = lat("naive", nbytes)
        if best is not None and naive is not None:
            speedups.append((nbytes, naive / best[1]))
    if speedups:
        ok = all(s >= GOAL_NAIVE for _, s in speedups)
        lines.append(f"{n} ranks, vs naive Dask: " + ", ".join(f"{format_size(nb)} {s:.3g}x" for nb, s in speedups)
                     + f" -> goal >= 10x at every size {verdict(ok)}")
    return lines


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None,
                        help=f"what to measure (default: {' '.join(DEFAULT_SYSTEMS)}); auto, shm, socket, dask and ucx "
                             "are daskdist's transports (on one host auto routes through shm; ucx needs ucxx)")
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                        help=f"message sizes (default {' '.join(DEFAULT_SIZES)})")
    parser.add_argument("--replicas", "--ranks", nargs="+", type=int, default=None,
                        help=f"rank counts, fresh processes each (default {' '.join(map(str, DEFAULT_REPLICAS))})")
    parser.add_argument("--quick", action="store_true",
                        help=f"sizes {' '.join(QUICK_SIZES)}, {QUICK_REPLICAS[0]} ranks and 1 round "
                             "(--sizes / --replicas / --rounds still override)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds the iterations are split into, phases reversed every other round (default 3)")
    parser.add_argument("--blocks", type=int, default=5,
                        help="blocks per size and round, each after an untimed all-reduce (default 5)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed iterations per size over all rounds (default: 1000 up to 256 KiB, "
                             "100 up to 4 MiB, 10 above; naive: at most 4 per block)")
    parser.add_argument("--implementation", choices=["auto", "ring"], default="auto",
                        help="daskdist CommunicationImplementation: auto (direct <= 64 KiB, else ring) or ring")
    parser.add_argument("--mpirun-args", default=None,
                        help="extra mpirun flags, one string (default: $DASKDIST_BENCH_MPIRUN_ARGS or none)")
    add_transport_option(parser)
    args = parser.parse_args(argv)
    systems = list(args.systems or DEFAULT_SYSTEMS)
    if args.transport is not None:
        if args.transport not in DASKDIST_TRANSPORTS:
            parser.error(f"--transport must be one of {', '.join(DASKDIST_TRANSPORTS)}")
        systems = [args.transport] + [s for s in systems if s not in DASKDIST_TRANSPORTS]
    args.systems = [s for s in SYSTEMS if s in systems]
    if args.sizes is None:
        args.sizes = [parse_size(s) for s in (QUICK_SIZES if args.quick else DEFAULT_SIZES)]
    if args.replicas is None:
        args.replicas = list(QUICK_REPLICAS if args.quick else DEFAULT_REPLICAS)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if any(n < 2 for n in args.replicas) or args.blocks < 1 or args.rounds < 1 or (args.iterations or 1) < 1:
        parser.error("--replicas must be at least 2, --blocks, --rounds and --iterations positive")
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure every rank count and print its tables, the ratios and the issue's goals."""
    args = parse_args(argv)
    print_header("float32 SUM all-reduce: daskdist transports vs MPI, gloo, naive Dask tasks and a memcpy bound")
    print(settings_line())
    print(f"systems: {' '.join(args.systems)}  sizes: {', '.join(format_size(s) for s in args.sizes)}  "
          f"ranks: {args.replicas}  rounds: {args.rounds}  blocks: {args.blocks}  "
          f"implementation: {args.implementation}  iterations: "
          f"{', '.join(f'{format_size(s)}={args.iterations or default_iterations(s)}' for s in args.sizes)}  "
          f"load average: {load()}\n", flush=True)
    start = time.perf_counter()
    measured = []
    for n in args.replicas:
        measured.append((n, measure_replicas(n, args)))
    for n, results in measured:
        print(f"\n{n} ranks: {n} processes on {os.cpu_count()} CPUs (daskdist: {n} single-threaded workers)\n")
        print(tables(n, results, args.sizes, args))
    print("\nlatency: median over iterations of the slowest rank (naive: client-side time per round); "
          "busbw = 2(n-1)/n * bytes / latency (GB/s = 1e9 B/s);\nideal = 2(n-1)/n * median np.copyto time "
          "(21 samples per round, not the iteration count)")
    lines = [line for n, results in measured for line in goals(n, results, args.sizes)]
    if lines:
        print("\nGoals (issue \"Fast collectives\", best daskdist transport per size):")
        for line in lines:
            print(f"  {line}")
    readings = sorted(_LOAD_READINGS)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; 1-minute load average between phases: "
          f"{readings[0]:.2f} to {readings[-1]:.2f} on {os.cpu_count()} CPUs" if readings else "")


if __name__ == "__main__":
    main()
