"""Where the suite's time goes, in CPU seconds (which a loaded machine does not inflate) and wall seconds.

With ``DASKDIST_TEST_CPU_LOG=<file>`` set, ``tests/conftest.py`` appends one JSON line per test: its id, the
wall seconds of its set-up, call and tear-down together, and the CPU seconds the pytest process spent in them
(``self``) and those of the child processes it reaped meanwhile (``children``: worker processes, nannies and
their own children, examples run as scripts). A module-scoped cluster's processes are counted in the test
whose tear-down closes them; the session's shared cluster in the last test's.

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


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class Sample:
    """The clocks at the start of one test."""

    def __init__(self) -> None:
        self.wall = time.monotonic()
        self.self_cpu = _cpu(resource.RUSAGE_SELF)
        self.children_cpu = _cpu(resource.RUSAGE_CHILDREN)

    def record(self, path: str, nodeid: str) -> None:
        """Append ``nodeid``'s line: the clocks' advance since this sample."""
        line = {"id": nodeid, "wall": round(time.monotonic() - self.wall, 3),
                "self": round(_cpu(resource.RUSAGE_SELF) - self.self_cpu, 3),
                "children": round(_cpu(resource.RUSAGE_CHILDREN) - self.children_cpu, 3),
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
            cpu[module] += line["self"] + line["children"]
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
