"""Python function calls per small all-reduce on a replica: the lane's per-call work, independent of load.

Counts the ``call`` events (``sys.setprofile``) of replica 0 over ``--calls``
4 KiB float32 SUM all-reduces with 2 replicas (after 50 warm-up calls), and
prints, per function, how many calls one all-reduce makes. The functions every
all-reduce calls (at least 0.98 per all-reduce) are the common path; the wait
loop (``_Spinner.idle`` and the abort checks it makes) counts the waiting, not
the work, and varies with timing (``Mailbox.check`` is called once per
all-reduce, and again by the wait loop). Run it with ``PYTHONPATH`` at each tree to
compare trees (BENCHMARKS.md section 7).

Run: ``python benchmarks/lane_calls.py [--calls 200]``.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

import numpy as np

#: The wait loop: how often it runs counts the waiting, not the work.
WAITING = ("_Spinner.idle", "ShmChannel.can_read", "<lambda>")


def count_calls(n: int) -> dict[str, float]:
    """Replica function: calls per all-reduce of each Python function, over ``n`` all-reduces."""
    import daskdist as dd

    ctx = dd.get_replica_context()
    x = np.ones(1024, np.float32)
    for _ in range(50):
        ctx.all_reduce(dd.ReduceOp.SUM, x)
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[frame.f_code.co_qualname] += 1

    sys.setprofile(profile)
    for _ in range(n):
        ctx.all_reduce(dd.ReduceOp.SUM, x)
    sys.setprofile(None)
    return {name: count / n for name, count in calls.items()}


def main() -> None:
    from distributed import Client, LocalCluster

    import daskdist as dd

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="all-reduces counted")
    args = parser.parse_args()
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
          Client(cluster) as client, dd.MirroredStrategy(client=client) as strategy):
        per_call = strategy.experimental_local_results(strategy.run(count_calls, args=(args.calls,)))[0]
    every = {k: v for k, v in per_call.items() if v >= 0.98 and not k.endswith(WAITING)}
    print(f"daskdist from {dd.__file__}")
    print(f"functions every all-reduce calls (the wait loop left out): {len(every)}")
    for name, count in sorted(per_call.items(), key=lambda kv: -kv[1]):
        mark = "" if name in every else "  (not every call: waiting or the slow path)"
        print(f"  {count:7.3f}  {name}{mark}")


if __name__ == "__main__":
    main()
