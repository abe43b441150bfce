"""What a 4 KiB all-reduce between two namespace hosts costs in plain Python, by how the bytes are received.

The goal: 4 KiB at most 2x Open MPI across two hosts. daskdist's
socket transport receives on a reader thread per peer and hands each message
to the replica thread through a mailbox (a condition variable), with a bounded
busy-poll before sleeping. This benchmark measures the floor of each shape on
the same two namespace hosts (``tests/netns.py``), without daskdist: two
processes, one per host, each doing ``iterations`` exchanges of a 4 KiB
float32 vector (send mine, receive the peer's, sum), as a 2-rank all-reduce
does:

* ``caller``: the calling thread sends and then blocks in ``recv_into``
  itself (no thread hand-off; what MPI does);
* ``reader+condition``: a reader thread per peer receives and hands the
  message over with ``threading.Condition`` (daskdist's shape without
  busy-poll);
* ``reader+spin``: the same hand-off, the waiting thread spinning on the
  mailbox (daskdist's ``busy-poll``; here unbounded).

Usage (as root)::

    .venv/bin/python benchmarks/multihost_small_floor.py [--iterations 2000] [--size 4096]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HEADER = struct.Struct("!II")  # sequence number, payload bytes
PORT = 29731


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _connect(rank: int, peer_address: str, my_address: str) -> socket.socket:
    if rank == 0:
        server = socket.create_server((my_address, PORT))
        sock, _ = server.accept()
        server.close()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection((peer_address, PORT))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Mailbox:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.messages: collections.deque = collections.deque()

    def put(self, item) -> None:
        with self.cond:
            self.messages.append(item)
            self.cond.notify()

    def take(self, spin: bool):
        if spin:
            while not self.messages:
                pass
            return self.messages.popleft()
        with self.cond:
            while not self.messages:
                self.cond.wait()
            return self.messages.popleft()


def _reader(sock: socket.socket, box: _Mailbox, size: int) -> None:
    header = bytearray(HEADER.size)
    try:
        while True:
            _recv_exact(sock, memoryview(header))
            _, nbytes = HEADER.unpack(header)
            data = np.empty(nbytes // 4, np.float32)
            _recv_exact(sock, memoryview(data).cast("B"))
            box.put(data)
    except (ConnectionError, OSError):
        box.put(None)


def _rank_main(rank: int, peer_address: str, my_address: str, mode: str, iterations: int, size: int) -> None:
    sock = _connect(rank, peer_address, my_address)
    mine = np.ones(size // 4, np.float32)
    out = np.empty_like(mine)
    incoming = np.empty_like(mine)
    box = _Mailbox()
    if mode != "caller":
        threading.Thread(target=_reader, args=(sock, box, size), daemon=True).start()
    times = []
    for i in range(iterations + 50):
        start = time.perf_counter()
        sock.sendall(HEADER.pack(i, mine.nbytes) + mine.tobytes())
        if mode == "caller":
            header = bytearray(HEADER.size)
            _recv_exact(sock, memoryview(header))
            _recv_exact(sock, memoryview(incoming).cast("B"))
            peer = incoming
        else:
            peer = box.take(spin=mode == "reader+spin")
        np.add(mine, peer, out=out)
        if i >= 50:
            times.append(time.perf_counter() - start)
    print(json.dumps({"rank": rank, "mode": mode, "median_ms": statistics.median(times) * 1e3,
                      "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3}), flush=True)
    sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--rank-of", nargs=5, help=argparse.SUPPRESS)  # rank peer mine mode iterations (internal)
    args = parser.parse_args()
    if args.rank_of:
        rank, peer, mine, mode, iterations = args.rank_of
        _rank_main(int(rank), peer, mine, mode, int(iterations), args.size)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import netns  # the test suite's namespace hosts

    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"namespace hosts unavailable: {reason}")
    print(f"load average at start: {os.getloadavg()}  cpus: {os.cpu_count()}  size: {args.size} B  "
          f"iterations: {args.iterations}", flush=True)
    hosts = netns.start_hosts(2, workers_per_host=0, rate="10gbit")
    try:
        h1, h2 = hosts.hosts
        for mode in ("caller", "reader+condition", "reader+spin"):
            procs = []
            for rank, (me, peer) in enumerate(((h1, h2), (h2, h1))):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", me.namespace, sys.executable, __file__, "--size", str(args.size),
                     "--rank-of", str(rank), peer.address, me.address, mode, str(args.iterations)],
                    stdout=subprocess.PIPE, text=True))
                if rank == 0:
                    time.sleep(0.5)
            results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
            worst = max(results, key=lambda r: r["median_ms"])
            print(f"{mode:18s} median {worst['median_ms']:.4f} ms  p90 {worst['p90_ms']:.4f} ms  "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        hosts.close()


if __name__ == "__main__":
    main()
