"""The floor of a cross-host all-reduce on a link: the bytes sent each way at once over plain TCP, no collective.

Two ranks, one per host (``rank_prefix``), each listening on ``port + rank``
and connecting to the other's (one connection per direction, as daskdist's
socket transport opens them); each "all-reduce" sends ``nbytes`` to the
other rank from a thread while the rank receives the other's ``nbytes``
with ``recv_into`` into one reused buffer: what any exact all-reduce
between two hosts must move across the link (each host's share once each
way), with no sum, no copy and no collective layer. Timed with
``_base.time_sizes``'s loop, so it reads beside the peers' figures.

Run by ``benchmarks/multihost_pipeline_ab.py --raw``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

if __name__ == "__main__" and not __package__:  # run as a script: make ``peers`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from peers._base import (
    RESULT_MARKER,
    PeerUnavailable,
    SizePlan,
    max_walls,
    parse_result,
    per_iteration_max,
    plan_from_json,
    plan_to_json,
    tail,
    time_sizes,
)

__all__ = ["run"]


def run(addresses: list[str], plan: list[SizePlan], port: int, rank_prefix: Callable[[int], list[str]],
        timeout: float = 600) -> dict:
    """Time ``plan`` between two ranks at ``addresses`` (rank ``r`` started with ``rank_prefix(r)``).

    Returns ``{"times": {nbytes: [seconds, max over ranks]}, "walls": {nbytes: seconds}}``.

    Raises
    ------
    PeerUnavailable
        A rank failed or the run timed out.
    """
    procs = [subprocess.Popen([*rank_prefix(rank), sys.executable, os.path.abspath(__file__), "--worker", str(rank),
                               json.dumps(addresses), str(port), plan_to_json(plan)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise PeerUnavailable(f"raw TCP rank failed: {tail(out)}")
            results.append(parse_result(out))
    except subprocess.TimeoutExpired as error:
        raise PeerUnavailable(f"raw TCP exchange timed out after {timeout:.0f} s") from error
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return {"times": per_iteration_max([r["times"] for r in results]), "walls": max_walls([r["walls"] for r in results])}


def _connect(address: str, port: int, deadline: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection((address, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _worker(rank: int, addresses: list[str], port: int, plan: list[SizePlan]) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addresses[rank], port + rank))
    listener.listen(1)
    outgoing = _connect(addresses[1 - rank], port + 1 - rank, time.monotonic() + 60)
    incoming, _ = listener.accept()
    listener.close()
    for sock in (outgoing, incoming):
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def setup(nbytes: int) -> tuple[memoryview, bytearray, int]:
        return memoryview(bytearray(nbytes)), bytearray(min(nbytes, 4 << 20)), nbytes

    def exchange(state: tuple[memoryview, bytearray, int]) -> None:
        payload, sink, nbytes = state
        sender = threading.Thread(target=outgoing.sendall, args=(payload,))
        sender.start()
        view, got = memoryview(sink), 0
        while got < nbytes:
            n = incoming.recv_into(view, min(len(sink), nbytes - got))
            if n == 0:
                raise ConnectionError("the other rank closed its connection")
            got += n
        sender.join()

    walls: dict[str, float] = {}
    times = time_sizes(plan, setup, exchange, lambda state: None, walls=walls)
    print(RESULT_MARKER + json.dumps({"times": times, "walls": walls}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), plan_from_json(sys.argv[5]))
    else:
        sys.exit(__doc__)
