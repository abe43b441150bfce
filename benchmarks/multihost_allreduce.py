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

Peers, on the same hosts and links, in the same layouts (rank ``r`` of a
layout with ``k`` ranks per host runs on host ``r // k``, every rank inside
its host's network, UTS and mount namespaces, entered with ``nsenter`` as the
Dask workers are), timed the same way inside their ranks; a peer that cannot
run is reported unavailable with the reason:

* TensorFlow's own MultiWorkerMirroredStrategy (``peers/tf_mwms_allreduce.py``):
  one TF task per replica (2 x 2: two tasks per host on two ports),
  ``TF_CONFIG`` on the namespace addresses,
  ``CommunicationOptions(implementation=RING)``.
* torch gloo (``peers/gloo_allreduce.py``): ``env://`` rendezvous with
  ``MASTER_ADDR`` on host 0's namespace address, ``GLOO_SOCKET_IFNAME=eth0``
  (TCP also between the two ranks of one host).
* Open MPI (``peers/mpi_allreduce.py``): ``mpirun`` in the root namespace with
  a hostfile naming the hosts' addresses (``slots`` = ranks per host), PRRTE's
  ssh launcher pointed at a generated agent script (``--prtemca plm_ssh_agent``)
  that starts the daemon inside the namespaces of the host it is given,
  ``oob_tcp_if_include`` and ``btl_tcp_if_include`` the hosts' subnet,
  ``--bind-to none`` (else both ranks of a host land on core 0), and
  ``mpi_yield_when_idle 1`` when there are more ranks than cores (what Open MPI
  sets itself when it sees that; each host's daemon sees only its own ranks).
  Inside a host the ranks use Open MPI's ``sm`` BTL (the host's private
  ``/dev/shm``).

The link-rate bound is what the bytes a host must send cost on its link: a
ring over 2 hosts sends ``bytes`` from each host (half in the reduce-scatter,
half in the all-gather), so ``bytes * 8 / rate``; the same with 2 replicas per
host (a host still has to send its partial sums of half the vector and the
finished other half).

Usage (as root)::

    .venv/bin/python benchmarks/multihost_allreduce.py [--sizes 4KiB 256KiB 4MiB 64MiB] [--rates 10gbit 1gbit]
        [--iterations 200 20 20 3] [--layouts 1 2] [--systems tf gloo mpi ucx daskdist]

``ucx`` is daskdist with ``daskdist.collective.transport: ucx`` (TCP underneath: veth has no RDMA); it needs
``ucxx`` in the interpreter that runs this script (``make test-ucx`` installs the ``ucx`` extra into ``.venv``;
or a separate venv that has it), and is reported unavailable otherwise. ``mpirun`` is looked up next to that
interpreter, then on ``PATH``: with a separate ucx venv, put the ``bench`` venv's ``bin/`` on ``PATH``
(``PATH=$PATH:.venv/bin .venv-ucx/bin/python benchmarks/multihost_allreduce.py ...``). Cells: the median per call and, in brackets, the wall time per call
over the timed loop (the untimed calls included), which shows a timed call overlapping the previous call's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _common import format_table, namespace_cluster, print_header  # noqa: E402
from peers import gloo_allreduce, mpi_allreduce  # noqa: E402
from peers._base import PeerUnavailable, SizePlan, format_size, parse_result, parse_size  # noqa: E402

__all__ = ["main"]

SYSTEMS = ("tf", "gloo", "mpi", "ucx", "daskdist")
COLUMNS = {"tf": "TF MWMS", "gloo": "gloo", "mpi": "Open MPI", "ucx": "daskdist ucx", "daskdist": "daskdist"}
OURS = ("daskdist", "ucx")
TF_PORT = 23456
GLOO_PORT = 29500

#: A system's result: median seconds by size, or why it is unavailable.
Result = dict[int, float] | str
#: Wall time per call by size (over the timed loop, the untimed calls included), slowest rank.
Walls = dict[int, float]


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {message}", file=sys.stderr, flush=True)


def _medians(times: dict[int, list[float]]) -> dict[int, float]:
    return {n: statistics.median(values) for n, values in times.items()}


def _slowest_per_iteration(per_rank: list[dict], sizes: list[int]) -> dict[int, list[float]]:
    return {n: [max(r[n][i] for r in per_rank) for i in range(len(per_rank[0][n]))] for n in sizes}


def _plan(sizes: list[int], iterations: list[int]) -> list[SizePlan]:
    """The peers' plan for the loop the daskdist replicas run: 3 warm-ups, then each timed call after an untimed one."""
    return [SizePlan(n, warmup=3, blocks=[1] * count) for n, count in zip(sizes, iterations)]


def _enter(host) -> list[str]:
    """Command prefix that runs a command inside ``host``'s namespaces (net, host name, ``/dev/shm``), as its workers."""
    from tests.netns import DIE_WITH_PARENT

    return [*DIE_WITH_PARENT, "nsenter", f"--net=/run/netns/{host.namespace}", f"--uts=/proc/{host.anchor.pid}/ns/uts",
            f"--mount=/proc/{host.anchor.pid}/ns/mnt", f"--wd={REPO}", "--"]


# -- daskdist -------------------------------------------------------------------------


def _timed_all_reduces(sizes: list[int], iterations: list[int]) -> dict[str, dict[int, Any]]:
    """Replica function: per size, warm-up then timed all-reduces (each after an untimed one).

    ``times``: each timed call's seconds; ``walls``: the timed loop's wall time per call (untimed calls included).
    """
    import daskdist as dd

    ctx = dd.get_replica_context()
    out: dict[str, dict[int, Any]] = {"times": {}, "walls": {}}
    for nbytes, count in zip(sizes, iterations):
        value = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            ctx.all_reduce("SUM", value)
        samples = []
        began = time.perf_counter()
        for _ in range(count):
            ctx.all_reduce("SUM", value)
            start = time.perf_counter()
            ctx.all_reduce("SUM", value)
            samples.append(time.perf_counter() - start)
        out["walls"][nbytes] = (time.perf_counter() - began) / (2 * count)
        out["times"][nbytes] = samples
    return out


def _daskdist(client, workers: list[str] | None, sizes, iterations,
              transport: str | None = None) -> tuple[Result, Walls]:
    """daskdist's MWMS over the chosen workers (``transport``: force one, e.g. ``ucx``); (medians, walls)."""
    import dask

    import daskdist as dd
    from daskdist.cluster_resolver import DaskClusterResolver
    from daskdist.replica import commands

    if transport == "ucx":
        import importlib.util

        if importlib.util.find_spec("ucxx") is None:
            return ("unavailable (ucxx not installed in this interpreter: run with a venv that has the ucx extra, "
                    "e.g. .venv/bin/python after make test-ucx)"), {}
    resolver = DaskClusterResolver(client, workers=workers) if workers else None
    settings = {"daskdist.collective.transport": transport} if transport else {}
    try:
        with dask.config.set(settings), dd.MultiWorkerMirroredStrategy(resolver, client=client) as strategy:
            per_rank = strategy.extended.group.call(commands.run_function,
                                                    (_timed_all_reduces, (sizes, iterations), {}))
    except Exception as error:  # noqa: BLE001  (a transport that cannot run here is reported, not fatal)
        if transport is None:
            raise
        return f"unavailable ({type(error).__name__}: {str(error)[:300]})", {}
    walls = {n: max(r["walls"][n] for r in per_rank) for n in sizes}
    return _medians(_slowest_per_iteration([r["times"] for r in per_rank], sizes)), walls


# -- peers ------------------------------------------------------------------------------


def run_tf_tasks(hosts, per_host: int, script: str, script_args: list[str], timeout: float = 300) -> list[dict] | str:
    """Run ``script`` as one TF task per replica (``per_host`` tasks on each namespace host, ``TF_CONFIG`` on the
    namespace addresses); each task's parsed result, or why not (also used by ``multihost_training.py``)."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        return "unavailable (tensorflow not installed: pip install tensorflow-cpu)"
    tasks = [(host, TF_PORT + k) for host in hosts.hosts for k in range(per_host)]
    cluster = {"worker": [f"{host.address}:{port}" for host, port in tasks]}
    procs = []
    for index, (host, _) in enumerate(tasks):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
                   PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen(
            [*_enter(host), sys.executable, str(REPO / script), *script_args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            try:
                results.append(parse_result(out))
            except ValueError:
                return "unavailable (failed: " + " | ".join(out.strip().splitlines()[-3:]) + ")"
    except subprocess.TimeoutExpired:
        return f"unavailable (did not finish in {timeout:g}s)"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _tf_mwms(hosts, per_host: int, sizes, iterations, timeout: float = 300) -> tuple[Result, Walls]:
    """TF MWMS with one TF task per replica (``per_host`` tasks on each namespace host); (medians, walls), or why not."""
    results = run_tf_tasks(hosts, per_host, "benchmarks/peers/tf_mwms_allreduce.py",
                           ["--sizes", *map(str, sizes), "--iterations", *map(str, iterations)], timeout)
    if isinstance(results, str):
        return results, {}
    times = [{int(n): t for n, t in r["times"].items()} for r in results]
    walls = {n: max(r["walls"][str(n)] for r in results) for n in sizes}
    return _medians(_slowest_per_iteration(times, sizes)), walls


def _gloo(hosts, per_host: int, plan: list[SizePlan], port: int,
          timeout: float = 600) -> tuple[Result, Walls, str]:
    """torch gloo, rank ``r`` inside host ``r // per_host``'s namespaces, the store on host 0; (medians, walls, info)."""
    try:
        result = gloo_allreduce.run(len(hosts.hosts) * per_host, plan, timeout,
                                    rank_prefix=lambda rank: _enter(hosts.hosts[rank // per_host]),
                                    master=(hosts.hosts[0].address, port), socket_ifname="eth0")
    except PeerUnavailable as error:
        return f"unavailable ({error})", {}, ""
    return _medians(result["times"]), result["walls"], result["info"]


#: PRRTE's ssh launcher runs ``AGENT [options] HOST COMMAND``: this agent runs COMMAND (PRRTE's daemon) in HOST's
#: namespaces instead of over ssh, and kills it if mpirun dies.
MPI_AGENT = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "mpi agent: no namespace host $host" >&2; exit 1;;
esac
exec setpriv --pdeathsig KILL -- nsenter --net=/run/netns/$ns --uts=/proc/$anchor/ns/uts --mount=/proc/$anchor/ns/mnt \\
    --wd={wd} -- /bin/sh -c "$*"
"""


def _mpi(hosts, per_host: int, plan: list[SizePlan], timeout: float = 600) -> tuple[Result, Walls, str]:
    """Open MPI, PRRTE's daemons started inside the hosts' namespaces by an ssh agent; (medians, walls, info)."""
    subnet = f"10.77.{hosts.subnet}.0/24"
    with tempfile.TemporaryDirectory(prefix="mpi-netns-") as tmp:
        agent, hostfile = Path(tmp, "nsenter-agent.sh"), Path(tmp, "hostfile")
        cases = "\n".join(f"  {h.address}) ns={h.namespace}; anchor={h.anchor.pid} ;;" for h in hosts.hosts)
        agent.write_text(MPI_AGENT.format(cases=cases, wd=shlex.quote(str(REPO))))
        agent.chmod(0o755)
        hostfile.write_text("".join(f"{h.address} slots={per_host}\n" for h in hosts.hosts))
        extra = ["--hostfile", str(hostfile), "--prtemca", "plm_ssh_agent", str(agent),
                 "--prtemca", "oob_tcp_if_include", subnet, "--mca", "btl_tcp_if_include", subnet, "--bind-to", "none"]
        if len(hosts.hosts) * per_host > (os.cpu_count() or 1):
            # the hosts share this machine's cores, which each host's daemon cannot see: tell the ranks what Open MPI
            # sets by itself when it sees more ranks than cores (without it, 2 x 2 at 4 MiB took 0.5-1.5 s, not 61 ms)
            extra += ["--mca", "mpi_yield_when_idle", "1"]
        try:
            result = mpi_allreduce.run(len(hosts.hosts) * per_host, plan, extra_args=shlex.join(extra), timeout=timeout)
        except PeerUnavailable as error:
            return f"unavailable ({error})", {}, ""
    return _medians(result["times"]), result["walls"], result["info"].replace(tmp, "$TMP")


# -- the run ----------------------------------------------------------------------------


def _rate_bits(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"rate {rate!r}: use e.g. 10gbit, 1gbit")


def _blas() -> str:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas['version']}"
    except (KeyError, TypeError, ValueError):
        return "unknown"


def _cell(result: Result, walls: Walls, n: int) -> str:
    """``median (wall per call)`` in ms."""
    if not isinstance(result, dict):
        return "-"
    wall = f" ({walls[n] * 1e3:.3g})" if n in walls else ""
    return f"{result[n] * 1e3:.3g}{wall}"


def _versus_best_peer(results: dict[str, Result], n: int) -> str:
    """daskdist's time over the fastest peer's (below 1: daskdist is ahead)."""
    ours = results.get("daskdist")
    peers = [r[n] for s, r in results.items() if s not in OURS and isinstance(r, dict)]
    if not isinstance(ours, dict) or not peers:
        return "-"
    return f"{ours[n] / min(peers):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[4096, 256 << 10, 4 << 20, 64 << 20])
    parser.add_argument("--iterations", type=int, nargs="+", default=None,
                        help="timed iterations per size (default 200 up to 256 KiB, 20 up to 4 MiB, 3 above)")
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit"])
    parser.add_argument("--layouts", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                        help="replicas (ranks) per host, on 2 hosts (default 1 2)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    args = parser.parse_args()
    iterations = args.iterations or [200 if n <= 256 << 10 else 20 if n <= 4 << 20 else 3 for n in args.sizes]
    if len(iterations) != len(args.sizes):
        parser.error("--iterations needs one count per size")
    print_header("All-reduce across namespace hosts: daskdist MultiWorkerMirroredStrategy, peers, link bound")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  numpy BLAS: {_blas()}  "
          f"iterations: {dict(zip(map(format_size, args.sizes), iterations))}", flush=True)

    plan = _plan(args.sizes, iterations)
    gloo_port = GLOO_PORT
    loads = []
    with namespace_cluster(2, max(args.layouts), rate=args.rates[0]) as (hosts, client):
        first_of_each = [next(a for a in client.scheduler_info()["workers"] if f"//{h.address}:" in a)
                         for h in hosts.hosts]
        for rate in args.rates:
            hosts.shape(rate)
            rows, notes = [], []
            for per_host in args.layouts:
                layout = f"2x{per_host}"
                results: dict[str, Result] = {}
                walls: dict[str, Walls] = {}
                for system in args.systems:
                    loads.append(os.getloadavg()[0])
                    start = time.monotonic()
                    info = ""
                    _log(f"{rate} {layout} {system} ...")
                    if system in OURS:
                        results[system], walls[system] = _daskdist(
                            client, first_of_each if per_host == 1 else None, args.sizes, iterations,
                            "ucx" if system == "ucx" else None)
                    elif system == "tf":
                        results[system], walls[system] = _tf_mwms(hosts, per_host, args.sizes, iterations)
                    elif system == "gloo":
                        results[system], walls[system], info = _gloo(hosts, per_host, plan, gloo_port)
                        gloo_port += 1
                    else:
                        results[system], walls[system], info = _mpi(hosts, per_host, plan)
                    _log(f"{rate} {layout} {system}: {time.monotonic() - start:.0f} s")
                    if isinstance(results[system], str):
                        notes.append(f"{layout} {COLUMNS[system]}: {results[system]}")
                    elif info and rate == args.rates[0]:
                        notes.append(f"{layout} {COLUMNS[system]}: {info}")
                for n in args.sizes:
                    bound = n * 8 / _rate_bits(rate) * 1e3
                    rows.append([rate, layout, format_size(n), f"{bound:.3g}",
                                 *[_cell(results.get(s, "not run"), walls.get(s, {}), n) for s in SYSTEMS],
                                 _versus_best_peer(results, n)])
            print(f"link {rate}, 2 hosts (median ms per call, slowest rank, and in brackets the wall time per call "
                  "over the timed loop, untimed calls included; last column: daskdist / fastest peer)")
            for note in notes:
                print(f"  {note}")
            print(format_table(["link", "hosts x replicas", "size", "bound",
                                *[COLUMNS[s] for s in SYSTEMS], "daskdist / best peer"], rows))
            print(flush=True)
    loads.append(os.getloadavg()[0])
    print(f"load average (1 min) before each system: min {min(loads):.2f}  median {statistics.median(loads):.2f}  "
          f"max {max(loads):.2f}")


if __name__ == "__main__":
    main()
