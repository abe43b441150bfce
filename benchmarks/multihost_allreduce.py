"""All-reduce across real separate hosts (network namespaces): daskdist's MWMS next to peers and the link bound.

Two "hosts" are made on this machine with ``tests/netns.py`` (network
namespaces joined by veth pairs and a bridge, own host name and ``/dev/shm``
per host, links shaped with ``tc ... tbf``; needs root and iproute2), with two
Dask workers each. For each link rate (``--rates``, default 10gbit and 1gbit)
and layout (2 hosts x 1 replica: one Dask worker per host selected with a
``DaskClusterResolver``; 2 hosts x 2 replicas: every worker), a
``MultiWorkerMirroredStrategy`` all-reduces float32 ones (SUM) of each size,
timed inside the replicas with ``time.perf_counter``; an iteration's time is
the slowest replica's, the figure the median over iterations (each timed call
preceded by an untimed one so the replicas enter it together).

Peers, run on the same hosts and links where installed (else reported
unavailable): TensorFlow's own MultiWorkerMirroredStrategy
(``peers/tf_mwms_allreduce.py``, one process per host inside the host's
namespaces, ``TF_CONFIG`` on the namespace addresses,
``CommunicationOptions(implementation=RING)``; 2 hosts x 1 only), torch gloo
and Open MPI (not wired here yet: reported unavailable).

The link-rate bound is what the bytes a host must send cost on its link: a
ring over 2 hosts sends ``bytes`` from each host (half in the reduce-scatter,
half in the all-gather), so ``bytes * 8 / rate``.

Usage (as root)::

    .venv/bin/python benchmarks/multihost_allreduce.py [--sizes 4KiB 256KiB 4MiB 64MiB] [--rates 10gbit 1gbit]
        [--iterations 200 50 10 3] [--no-tf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _common import format_table, print_header  # noqa: E402
from peers._base import format_size, parse_size  # noqa: E402

__all__ = ["main"]

RESULT_MARKER = "@@allreduce-result "


def _timed_all_reduces(sizes: list[int], iterations: list[int]) -> dict[int, list[float]]:
    """Replica function: per size, warm-up then timed all-reduces (each after an untimed one)."""
    import daskdist as dd

    ctx = dd.get_replica_context()
    out = {}
    for nbytes, count in zip(sizes, iterations):
        value = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            ctx.all_reduce("SUM", value)
        samples = []
        for _ in range(count):
            ctx.all_reduce("SUM", value)
            start = time.perf_counter()
            ctx.all_reduce("SUM", value)
            samples.append(time.perf_counter() - start)
        out[nbytes] = samples
    return out


def _daskdist(client, workers: list[str] | None, sizes, iterations) -> dict[int, float]:
    import daskdist as dd
    from daskdist.cluster_resolver import DaskClusterResolver
    from daskdist.replica import commands

    resolver = DaskClusterResolver(client, workers=workers) if workers else None
    with dd.MultiWorkerMirroredStrategy(resolver, client=client) as strategy:
        per_rank = strategy.extended.group.call(commands.run_function, (_timed_all_reduces, (sizes, iterations), {}))
    return {n: statistics.median(max(r[n][i] for r in per_rank) for i in range(len(per_rank[0][n]))) for n in sizes}


def _tf_mwms(hosts, sizes, iterations, timeout: float = 300) -> dict[int, float] | str:
    """TF MWMS on 2 hosts x 1 (one TF process per namespace host); its medians, or why it is unavailable."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        return "unavailable (tensorflow not installed: pip install tensorflow-cpu)"
    port = 23456
    cluster = {"worker": [f"{h.address}:{port}" for h in hosts.hosts]}
    procs = []
    for index, host in enumerate(hosts.hosts):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
                   PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "--", "nsenter", f"--net=/run/netns/{host.namespace}",
             f"--uts=/proc/{host.anchor.pid}/ns/uts", f"--mount=/proc/{host.anchor.pid}/ns/mnt", f"--wd={REPO}",
             "--", sys.executable, str(REPO / "benchmarks/peers/tf_mwms_allreduce.py"),
             "--sizes", *map(str, sizes), "--iterations", *map(str, iterations)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            line = next((ln for ln in out.splitlines() if ln.startswith(RESULT_MARKER)), None)
            if line is None:
                return "unavailable (failed: " + " | ".join(out.strip().splitlines()[-3:]) + ")"
            results.append(json.loads(line[len(RESULT_MARKER):])["times"])
    except subprocess.TimeoutExpired:
        return f"unavailable (did not finish in {timeout:g}s)"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return {n: statistics.median(max(r[str(n)][i] for r in results) for i in range(len(results[0][str(n)])))
            for n in sizes}


def _rate_bits(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"rate {rate!r}: use e.g. 10gbit, 1gbit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[4096, 256 << 10, 4 << 20, 64 << 20])
    parser.add_argument("--iterations", type=int, nargs="+", default=None,
                        help="per size (default 200 up to 256 KiB, 20 up to 4 MiB, 3 above)")
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit"])
    parser.add_argument("--no-tf", action="store_true", help="skip TensorFlow's MWMS")
    args = parser.parse_args()
    iterations = args.iterations or [200 if n <= 256 << 10 else 20 if n <= 4 << 20 else 3 for n in args.sizes]
    print_header("All-reduce across namespace hosts: daskdist MultiWorkerMirroredStrategy, peers, link bound")

    from distributed import Client

    from tests.netns import start_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot make namespace hosts here: {reason}")
    hosts = start_hosts(2, 2)
    try:
        with Client(hosts.scheduler_address, set_as_default=False) as client:
            client.wait_for_workers(4, timeout=120)
            first_of_each = [next(a for a in client.scheduler_info()["workers"] if f"//{h.address}:" in a)
                             for h in hosts.hosts]
            for rate in args.rates:
                hosts.shape(rate)
                rows = []
                one = _daskdist(client, first_of_each, args.sizes, iterations)
                two = _daskdist(client, None, args.sizes, iterations)
                tf = "skipped (--no-tf)" if args.no_tf else _tf_mwms(hosts, args.sizes, iterations)
                for n in args.sizes:
                    bound = n * 8 / _rate_bits(rate) * 1e3
                    tf_cell = f"{tf[n] * 1e3:.3f}" if isinstance(tf, dict) else "-"
                    rows.append([rate, format_size(n), f"{bound:.4g}", tf_cell, "-", "-",
                                 f"{one[n] * 1e3:.3f}", f"{two[n] * 1e3:.3f}"])
                print(f"link {rate} (median ms, slowest rank; TF MWMS: {tf if isinstance(tf, str) else 'RING, 2 x 1'};"
                      " gloo, Open MPI: unavailable (not wired into this script yet))")
                print(format_table(["link", "size", "bound", "TF MWMS 2x1", "gloo", "Open MPI",
                                    "daskdist 2x1", "daskdist 2x2"], rows))
                print(flush=True)
    finally:
        hosts.close()


if __name__ == "__main__":
    main()
