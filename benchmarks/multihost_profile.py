"""Where the time of a cross-host all-reduce goes, per thread: py-spy on the replicas of 2 namespace hosts.

Two namespace hosts with one Dask worker each (``tests/netns.py``; root and
iproute2), links shaped to each ``--rates``; a ``MultiWorkerMirroredStrategy``
over both runs SUM all-reduces of float32 ones of each ``--sizes`` in a loop
(``--calls``), while for ``--seconds`` ``py-spy record --threads --idle --nonblocking``
samples every thread of both workers (``--nonblocking``: the process is not
stopped to sample it). For each thread of rank 0 the script prints its share
of the samples by innermost Python function (the frame the thread was in:
running, or blocked in a wait or a system call), and the calls per second.
Needs ``py-spy`` (``pip install py-spy``).

Usage (as root)::

    .venv/bin/python benchmarks/multihost_profile.py [--sizes 4KiB 64MiB] [--rates 10gbit 1gbit] [--seconds 8]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from peers._base import format_size, parse_size  # noqa: E402

__all__ = ["main"]


def _loop(nbytes: int, calls: int) -> dict[str, Any]:
    """Replica function: ``calls`` all-reduces of ``nbytes`` (a count, alike on every replica); their median."""
    import daskdist as dd

    ctx = dd.get_replica_context()
    value = np.ones(nbytes // 4, np.float32)
    for _ in range(3):
        ctx.all_reduce("SUM", value)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        ctx.all_reduce("SUM", value)
        times.append(time.perf_counter() - start)
    return {"calls": len(times), "median": float(np.median(times)), "seconds": float(sum(times))}


_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^:()]*)(?::\d+)?\)$")


def _summary(raw: Path, top: int) -> list[str]:
    """Per thread: samples, then the innermost functions with their share of the thread's samples."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), frames[0])
        leaf = frames[-1]
        match = _FRAME.match(leaf)
        if match:
            leaf = f"{match['function']} ({Path(match['file']).name})"
        threads[thread][leaf] += int(count)
    out = []
    for thread, leaves in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(leaves.values())
        shares = ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in leaves.most_common(top))
        out.append(f"    {thread}: {total} samples: {shares}")
    return out


def _tcp_state(namespace: str) -> list[str]:
    """``ss -tmi`` of the established TCP connections with data queued or in flight, inside ``namespace``."""
    done = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-tmiH", "state", "established"],
                          capture_output=True, text=True, timeout=30)
    lines, out = done.stdout.splitlines(), []
    for head, detail in zip(lines[::2], lines[1::2]):
        fields = {k: v for k, _, v in (item.partition(":") for item in detail.split()) if v}
        keep = {k: fields[k] for k in ("rtt", "cwnd", "skmem", "send", "delivery_rate", "rcv_space") if k in fields}
        if int(fields.get("bytes_acked", "0")) > 1 << 20:  # the replicas' data connections, not Dask's comms
            out.append(f"{' '.join(head.split()[2:4])} {keep}")
    return out or ["(no connection with more than 1 MiB acknowledged)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[4096, 64 << 20])
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit"])
    parser.add_argument("--seconds", type=float, default=5.0, help="py-spy's sampling time, from 1 s after the start")
    parser.add_argument("--calls", type=int, nargs="+", default=None,
                        help="all-reduces per size (default: 4000 up to 256 KiB, 12 above); make them outlast --seconds")
    parser.add_argument("--top", type=int, default=6, help="functions shown per thread")
    parser.add_argument("--rate-hz", type=int, default=1000, help="py-spy samples per second")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        sys.exit("py-spy not found: pip install py-spy")

    from distributed import Client

    import daskdist as dd
    from daskdist.replica import commands
    from tests.netns import start_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot make namespace hosts here: {reason}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    hosts = start_hosts(2, 1)
    tmp = Path(tempfile.mkdtemp(prefix="daskdist-profile-"))
    try:
        with Client(hosts.scheduler_address, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            pids = [h.workers[0].pid for h in hosts.hosts]
            with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
                for rate in args.rates:
                    hosts.shape(rate)
                    for nbytes, calls in zip(args.sizes, args.calls or [4000 if n <= 256 << 10 else 12
                                                                         for n in args.sizes]):
                        load = os.getloadavg()[0]
                        result: dict[str, Any] = {}

                        def run(nbytes: int = nbytes, calls: int = calls, result: dict[str, Any] = result) -> None:
                            result["ranks"] = strategy.extended.group.call(
                                commands.run_function, (_loop, (nbytes, calls), {}))

                        runner = threading.Thread(target=run, daemon=True)
                        runner.start()
                        time.sleep(1.0)  # past the warm-up calls
                        raws = [tmp / f"{rate}-{nbytes}-rank{r}.txt" for r in range(2)]
                        spies = [subprocess.Popen(
                            [py_spy, "record", "--pid", str(pid), "--threads", "--idle", "--nonblocking",
                             "--rate", str(args.rate_hz), "--duration", str(int(args.seconds)), "--format", "raw",
                             "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                            for pid, raw in zip(pids, raws)]
                        time.sleep(args.seconds / 2)
                        sockets = _tcp_state(hosts.hosts[0].namespace)
                        for spy in spies:
                            spy.wait()
                        runner.join()
                        ranks = result.get("ranks") or []
                        print(f"\n{rate}, {format_size(nbytes)}, 2 hosts x 1 replica, load {load:.2f}: "
                              + "; ".join(f"rank {r}: {x['calls']} calls, median {x['median'] * 1e3:.3g} ms, "
                                          f"{x['calls'] / x['seconds']:.0f} calls/s" for r, x in enumerate(ranks)),
                              flush=True)
                        print("  TCP on host 0 mid-run (ss -tmi: rtt, cwnd, socket memory; the kernel autotunes "
                              "the buffers):")
                        print("\n".join(f"    {line}" for line in sockets), flush=True)
                        for r, raw in enumerate(raws):
                            if raw.exists():
                                print(f"  rank {r} (py-spy, {args.rate_hz} Hz, every thread, idle included):")
                                print("\n".join(_summary(raw, args.top)), flush=True)
                            else:
                                print(f"  rank {r}: py-spy recorded nothing")
    finally:
        hosts.close()
    print(f"\nraw py-spy stacks: {tmp}")


if __name__ == "__main__":
    main()
