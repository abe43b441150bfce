"""Where the suite's time goes, in CPU seconds (which a loaded machine does not inflate) and wall seconds.

With ``DASKDIST_TEST_CPU_LOG=<file>`` set, ``tests/conftest.py`` appends one JSON line per test: its id, the
wall seconds of its set-up, call and tear-down together, and the CPU seconds the pytest process spent in them
(``self``) and those of the child processes it reaped meanwhile (``children``: worker processes, nannies and
their own children, examples run as scripts). A module-scoped cluster's processes are counted in the test
whose tear-down closes them; the session's shared cluster in the last test's. Workers forked from the
session's fork server are that server's children, never reaped here: ``ProcessWorkers.close`` asks each
for its own CPU seconds before it closes them and notes them here (``workers``; a killed one's are lost).

``python -m tests.support.cpu_profile <file> [N]`` prints the totals and the ``N`` modules that cost most.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

#: The environment variable naming the log file; unset: nothing is recorded.
LOG_ENV = "DASKDIST_TEST_CPU_LOG"


_noted = [0.0]


def note_worker_cpu(seconds: float) -> None:
    """Add CPU seconds that worker processes reported themselves (forked ones are not this process's children)."""
    _noted[0] += seconds


def process_cpu() -> float:
    """This process's own CPU seconds (what a worker reports to ``note_worker_cpu``)."""
    return _cpu(resource.RUSAGE_SELF)


def note_cluster_cpu(client) -> None:
    """Note the CPU seconds of ``client``'s worker processes, when a log is kept (call before closing them)."""
    if not os.environ.get(LOG_ENV):
        return
    try:
        note_worker_cpu(sum(client.run(process_cpu, on_error="ignore").values()))
    except Exception:  # noqa: BLE001 (a profile without these seconds, never a failed close)
        pass


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class Sample:
    """The clocks at the start of one test."""

    def __init__(self) -> None:
        self.wall = time.monotonic()
        self.self_cpu = _cpu(resource.RUSAGE_SELF)
        self.children_cpu = _cpu(resource.RUSAGE_CHILDREN)
        self.workers_cpu = _noted[0]

    def record(self, path: str, nodeid: str) -> None:
        """Append ``nodeid``'s line: the clocks' advance since this sample."""
        line = {"id": nodeid, "wall": round(time.monotonic() - self.wall, 3),
                "self": round(_cpu(resource.RUSAGE_SELF) - self.self_cpu, 3),
                "children": round(_cpu(resource.RUSAGE_CHILDREN) - self.children_cpu, 3),
                "workers": round(_noted[0] - self.workers_cpu, 3),
                "load": os.getloadavg()[0]}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def summary(path: str, top: int = 25) -> str:
    """The totals and the ``top`` modules by CPU seconds, as text."""
    wall: collections.Counter = collections.Counter()
    cpu: collections.Counter = collections.Counter()
    tests: collections.Counter = collections.Counter()
    loads = []
    with open(path) as f:
        for raw in f:
            line = json.loads(raw)
            module = line["id"].split("::")[0]
            wall[module] += line["wall"]
            cpu[module] += line["self"] + line["children"] + line.get("workers", 0.0)
            tests[module] += 1
            loads.append(line["load"])
    total_wall, total_cpu = sum(wall.values()), sum(cpu.values())
    out = [f"{sum(tests.values())} tests: {total_wall:.0f} s wall, {total_cpu:.0f} s CPU "
           f"(load average {min(loads):.1f}-{max(loads):.1f}, mean {sum(loads) / len(loads):.1f})",
           f"{'CPU s':>8} {'wall s':>8} {'tests':>6}  module"]
    for module, seconds in cpu.most_common(top):
        out.append(f"{seconds:8.1f} {wall[module]:8.1f} {tests[module]:6d}  {module}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25))
