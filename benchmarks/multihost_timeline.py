"""Where a small all-reduce between two namespace hosts spends its time: a per-message timeline.

Two namespace hosts with one Dask worker each (``tests/netns.py``; root and
iproute2), links at ``--rate``. A ``MultiWorkerMirroredStrategy`` over both
runs ``--calls`` SUM all-reduces of ``--size`` bytes; inside each replica the
socket transport's steps are stamped with ``time.perf_counter_ns`` (the
hosts share one kernel, so CLOCK_MONOTONIC is one clock across them):

* ``call``: the replica thread calls ``ctx.all_reduce``;
* ``write`` / ``written``: ``sendmsg`` of the frames (signature and data) starts / returns;
* ``read``: the peer's reader thread has a whole frame (``recv`` returned and the frame is decoded);
* ``put``: the frame is in the mailbox (or handed to the posted receive);
* ``wait``: the peer's replica thread asks its mailbox for the message (its wait begins);
* ``woke``: the peer's replica thread has the message (its wait returned);
* ``done``: ``all_reduce`` returns.

For each step it prints the median time from the sender's ``write`` on (the
hop across the wire: ``write -> read`` on the other host), and the thread
hand-offs (a different thread stamping the next step) per call. The same
sitting measures the raw TCP round trip of ``--size`` bytes between the same
hosts (two Python processes doing ``send`` then a blocking ``recv_into``,
``benchmarks/multihost_small_floor.py``'s ``caller`` mode).

Usage (as root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/multihost_timeline.py [--size 4096] [--calls 2000] [--rate 10gbit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _common import format_table, namespace_cluster, print_header  # noqa: E402

STEPS = ("call", "write", "written", "read", "put", "wait", "woke", "done")


def _traced_all_reduces(size: int, calls: int) -> dict[str, Any]:
    """Replica function: stamp the socket transport's steps of ``calls`` all-reduces; the stamps and the medians."""
    import daskdist as dd
    from daskdist import wire
    from daskdist.collective import mailbox as mailbox_module
    from daskdist.collective.transport import socket as socket_module
    from daskdist.collective.transport import socket_inbound as inbound_module

    stamps: list[tuple[str, int, int, int]] = []  # (step, seq, thread id, ns)
    now, ident = time.perf_counter_ns, threading.get_ident
    current = {"seq": -1}
    saved = (socket_module.wire.send_parts, mailbox_module.Mailbox.put,
             mailbox_module.Mailbox.take, inbound_module.Inbound.read_frame)

    def send_parts(sock, parts):
        stamps.append(("write", current["seq"], ident(), now()))
        try:
            return saved[0](sock, parts)
        finally:
            stamps.append(("written", current["seq"], ident(), now()))

    def put(self, tag, value):
        stamps.append(("put", tag[1], ident(), now()))
        return saved[1](self, tag, value)

    def take(self, tag, deadline):
        stamps.append(("wait", tag[1], ident(), now()))
        value = saved[2](self, tag, deadline)
        stamps.append(("woke", tag[1], ident(), now()))
        return value

    def read_frame(self):
        tag, value = saved[3](self)
        stamps.append(("read", tag[1], ident(), now()))
        return tag, value

    socket_module.wire.send_parts = send_parts
    mailbox_module.Mailbox.put, mailbox_module.Mailbox.take = put, take
    inbound_module.Inbound.read_frame = read_frame
    try:
        ctx = dd.get_replica_context()
        value = np.ones(size // 4, np.float32)
        for _ in range(20):
            ctx.all_reduce("SUM", value)
        stamps.clear()
        times = []
        comm = dd.context.current_runtime().communicator
        for _ in range(calls):
            current["seq"] = comm.seq + 1
            stamps.append(("call", current["seq"], ident(), now()))
            start = time.perf_counter()
            ctx.all_reduce("SUM", value)
            times.append(time.perf_counter() - start)
            stamps.append(("done", current["seq"], ident(), now()))
    finally:
        (wire.send_parts, mailbox_module.Mailbox.put, mailbox_module.Mailbox.take,
         inbound_module.Inbound.read_frame) = saved
    return {"stamps": stamps, "median": statistics.median(times), "rank": ctx.replica_id_in_sync_group}


def _first(stamps: list, step: str, seq: int) -> tuple[int, int] | None:
    for s, q, thread, ns in stamps:
        if s == step and q == seq:
            return thread, ns
    return None


def _timeline(per_rank: list[dict]) -> tuple[list[list[str]], float]:
    """Rows: for each rank's receive side, the median time of each step after the sender's first ``write``."""
    rows = []
    handoffs = []
    for receiver in per_rank:
        sender = per_rank[1 - per_rank.index(receiver)]
        seqs = sorted({q for s, q, _, _ in receiver["stamps"] if s == "call"})
        offsets: dict[str, list[float]] = {s: [] for s in STEPS}
        for seq in seqs:
            write = _first(sender["stamps"], "write", seq)
            if write is None:
                continue
            chain = [("call (sender)", _first(sender["stamps"], "call", seq)), ("write (sender)", write),
                     ("written (sender)", _first(sender["stamps"], "written", seq))]
            chain += [(s, _first(receiver["stamps"], s, seq)) for s in ("read", "put", "wait", "woke", "done")]
            if any(v is None for _, v in chain):
                continue
            for name, (_, ns) in chain:
                offsets.setdefault(name, []).append((ns - write[1]) / 1e3)
            threads = [v[0] for _, v in chain if v is not None]  # type: ignore[index]
            handoffs.append(sum(1 for a, b in zip(threads, threads[1:]) if a != b))
        for name, values in offsets.items():
            if values:
                rows.append([f"rank {sender['rank']} -> {receiver['rank']}", name,
                             f"{statistics.median(values):.1f}", f"{np.percentile(values, 90):.1f}"])
    return rows, statistics.median(handoffs) if handoffs else float("nan")


def _raw_round_trip(hosts: Any, size: int, iterations: int) -> float:
    """The raw TCP exchange of ``size`` bytes (send, then a blocking ``recv_into``), ms, slowest rank."""
    script = str(REPO / "benchmarks" / "multihost_small_floor.py")
    h1, h2 = hosts.hosts
    procs = []
    for rank, (me, peer) in enumerate(((h1, h2), (h2, h1))):
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", me.namespace, sys.executable, script, "--size", str(size),
             "--rank-of", str(rank), peer.address, me.address, "caller", str(iterations)],
            stdout=subprocess.PIPE, text=True))
        if rank == 0:
            time.sleep(0.5)
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    return max(r["median_ms"] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rate", default="10gbit")
    args = parser.parse_args()
    import daskdist as dd
    from daskdist.replica import commands

    print_header(f"Per-message timeline of a {args.size} B all-reduce between two namespace hosts")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with namespace_cluster(2, 1, rate=args.rate) as (hosts, client):
        raw_before = _raw_round_trip(hosts, args.size, args.calls)
        with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
            per_rank = strategy.extended.group.call(commands.run_function,
                                                    (_traced_all_reduces, (args.size, args.calls), {}))
        raw_after = _raw_round_trip(hosts, args.size, args.calls)
    rows, handoffs = _timeline(per_rank)
    print("microseconds after the sender's write (median, p90), per direction:")
    print(format_table(["direction", "step", "median us", "p90 us"], rows))
    median = max(r["median"] for r in per_rank) * 1e3
    raw = (raw_before + raw_after) / 2
    print(f"all-reduce median {median:.4f} ms (slowest rank); raw TCP exchange {raw_before:.4f} / {raw_after:.4f} ms "
          f"(before / after); ratio {median / raw:.1f}x; thread hand-offs per message (call to done, median) "
          f"{handoffs:g}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
