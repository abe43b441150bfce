"""Per-call timeline of the hierarchical all-reduce at 2 hosts x 2 replicas: where each call's time goes, per rank.

Two namespace hosts with two Dask workers each (``tests/netns.py``; root,
iproute2), links at ``--rate``. Every replica runs ``multihost_allreduce``'s
loop (warm-ups, then each timed call after an untimed one) and stamps, with
``time.perf_counter_ns`` (one kernel: one clock across the hosts), each
message of every call: when the replica thread sends it, when a receive for
it starts and returns, when the socket writer has written a frame and when
the reader thread has read one whole. For each call it prints, relative to
the earliest entry of the call:

* each rank's entry and return;
* the fill: when a leader has its host's other replica's first piece, and
  when that replica has handed all its pieces up to the transport;
* each leader's first cross-host send (the link starts), its reader's last
  cross-host frame and its writer's last one;
* the drain: the leader's last send down to its host's other replica and that
  replica's last receive;

then, for the last two calls, every cross-host piece: handed to the
transport, written, read whole on the other host, and its receive there.

Usage (as root)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/multihost_hier_probe.py [--size 64MiB] [--calls 6] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from _common import format_table, namespace_cluster, print_header  # noqa: E402
from peers._base import parse_size  # noqa: E402

__all__ = ["main"]


def _stamped_calls(nbytes: int, calls: int) -> dict[str, Any]:
    """Replica function: ``multihost_allreduce``'s loop with every message stamped; the stamps."""
    import daskdist as dd
    from daskdist.collective.core import call as call_module
    from daskdist.collective.transport import socket as socket_module
    from daskdist.collective.transport import socket_inbound as inbound_module

    stamps: list[tuple[int, str, str, int]] = []  # (seq, event, message name, ns)
    now = time.perf_counter_ns
    current = {"seq": -1}
    cls = call_module.CollectiveCall
    saved = (cls.send, cls.recv_into, inbound_module.Inbound.read_frame, socket_module.SocketTransport._write)

    def send(self, dst, name, payload):
        stamps.append((self.seq, "send", name, now()))
        try:
            return saved[0](self, dst, name, payload)
        finally:
            stamps.append((self.seq, "sent", name, now()))

    def recv_into(self, src, name, out, op, base=None):
        stamps.append((self.seq, "recv", name, now()))
        try:
            return saved[1](self, src, name, out, op, base)
        finally:
            stamps.append((self.seq, "got", name, now()))

    def read_frame(self):
        tag, value = saved[2](self)
        name = str(tag[3]).split("#")[0] if len(tag) > 3 else "?"
        stamps.append((tag[1], "read1", name, now()))
        return tag, value

    def write(self, dst, peer, frames):
        began = now()
        try:
            return saved[3](self, dst, peer, frames)
        finally:
            for tag, *_ in frames:
                name = str(tag[3]).split("#")[0] if len(tag) > 3 else "?"
                stamps.append((tag[1], "write0", name, began))
                stamps.append((tag[1], "write1", name, now()))

    cls.send, cls.recv_into, inbound_module.Inbound.read_frame = send, recv_into, read_frame
    socket_module.SocketTransport._write = write
    try:
        ctx = dd.get_replica_context()
        comm = dd.context.current_runtime().communicator
        value = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            ctx.all_reduce("SUM", value)
        stamps.clear()
        times = []
        for i in range(2 * calls):
            current["seq"] = comm.seq + 1
            stamps.append((current["seq"], "enter", "", now()))
            start = time.perf_counter()
            ctx.all_reduce("SUM", value)
            if i % 2:
                times.append(time.perf_counter() - start)
            stamps.append((current["seq"], "return", "", now()))
    finally:
        cls.send, cls.recv_into, inbound_module.Inbound.read_frame, socket_module.SocketTransport._write = saved
    return {"stamps": stamps, "times": times, "rank": ctx.replica_id_in_sync_group}


CROSS = re.compile(r"hx\d*-")  # a cross-host ring's messages: ``hx-`` (first senders) or ``hx<slice>-`` (all senders)


def _matches(name: str, prefix: str) -> bool:
    return bool(CROSS.search(name)) if prefix == "hx-" else prefix in name


def _at(stamps: list, seq: int, event: str, prefix: str = "", last: bool = False) -> float | None:
    hits = [ns for q, e, name, ns in stamps if q == seq and e == event and _matches(name, prefix)]
    if not hits:
        return None
    return (max(hits) if last else min(hits)) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=64 << 20)
    parser.add_argument("--calls", type=int, default=6, help="timed calls (each after an untimed one)")
    parser.add_argument("--rate", default="1gbit")
    args = parser.parse_args()
    import daskdist as dd
    from daskdist.replica import commands

    print_header(f"Hierarchical all-reduce of {args.size} B at 2 hosts x 2 replicas: a per-call timeline")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with namespace_cluster(2, 2, rate=args.rate) as (hosts, client):
        with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
            per_rank = strategy.extended.group.call(commands.run_function,
                                                    (_stamped_calls, (args.size, args.calls), {}))
    per_rank.sort(key=lambda r: r["rank"])
    seqs = sorted({q for r in per_rank for q, e, _, _ in r["stamps"] if e == "enter"})
    rows = []
    for index, seq in enumerate(seqs):
        t0 = min(_at(r["stamps"], seq, "enter") for r in per_rank)

        def rel(value: float | None, t0: float = t0) -> str:
            return "-" if value is None else f"{value - t0:.1f}"

        for r in per_rank:
            s = r["stamps"]
            leader = _at(s, seq, "send", "hx-") is not None
            rows.append([
                str(seq), "timed" if index % 2 else "untimed", str(r["rank"]), "sender" if leader else "other",
                rel(_at(s, seq, "enter")),
                rel(_at(s, seq, "got", "h-up")),  # leader: the first piece from its host's others is in
                rel(_at(s, seq, "sent", "h-up", last=True)),  # other: its last piece up handed to the transport
                rel(_at(s, seq, "send", "hx-")),  # the link starts (leader)
                rel(_at(s, seq, "read1", "hx-", last=True)),  # last cross-host byte read
                rel(_at(s, seq, "write1", "hx-", last=True)),  # own last cross-host frame written
                rel(_at(s, seq, "send", "h-down", last=True)),  # leader: last piece sent down
                rel(_at(s, seq, "got", "h-down", last=True)),  # other: last piece received
                rel(_at(s, seq, "return")),
            ])
    print(format_table(["seq", "call", "rank", "role", "enter", "first up got", "last up sent", "link start (send)",
                        "last hx read", "last hx written", "last down send", "last down got", "return"], rows))
    rings: dict[str, list[dict]] = {}  # each cross-host ring's members, by its messages' prefix
    for r in per_rank:
        found = {m.group(0) for _, e, n, _ in r["stamps"] if e == "send" and (m := CROSS.search(n))}
        for prefix in found:
            rings.setdefault(prefix, []).append(r)
    for seq in seqs[-2:]:
        t0 = min(_at(r["stamps"], seq, "enter") for r in per_rank)
        piece_rows = []
        for prefix, members in sorted(rings.items()):
            for me, peer in ((members[0], members[1]), (members[1], members[0])):
                names = []
                for q, e, n, _ in me["stamps"]:
                    if q == seq and e == "send" and n.startswith(prefix) and n not in names:
                        names.append(n)
                for n in names:
                    def one(r, event, name=n, seq=seq, t0=t0):
                        hits = [ns / 1e6 - t0 for q, e, nm, ns in r["stamps"]
                                if q == seq and e == event and nm.split("#")[0].endswith(name)]
                        return f"{hits[0]:.1f}" if hits else "-"
                    piece_rows.append([f"{me['rank']} -> {peer['rank']}", n, one(me, "send"), one(me, "write0"),
                                       one(me, "write1"), one(peer, "read1"), one(peer, "recv"), one(peer, "got")])
        print(f"call {seq}: each cross-host piece, ms after the call's first entry")
        print(format_table(["direction", "piece", "send", "write starts", "written", "read (peer)", "recv (peer)",
                            "got (peer)"], piece_rows))
    times = [max(r["times"][i] for r in per_rank) * 1e3 for i in range(args.calls)]
    spreads = [max(_at(r["stamps"], q, "enter") for r in per_rank) - min(_at(r["stamps"], q, "enter") for r in per_rank)
               for q in seqs]
    wall = (max(_at(r["stamps"], seqs[-1], "return") for r in per_rank)
            - min(_at(r["stamps"], seqs[0], "enter") for r in per_rank)) / len(seqs)
    print(f"timed calls, slowest rank, ms: {' '.join(f'{t:.1f}' for t in times)}  median {statistics.median(times):.1f}"
          f"; entries apart (every call) median {statistics.median(spreads):.1f} ms, max {max(spreads):.1f}; "
          f"wall per call {wall:.1f} ms; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
