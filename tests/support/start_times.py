"""How long a test's set of worker processes takes to start: forked from the fork server, or the CLI with nannies.

    python -m tests.support.start_times [ROUNDS]

Starts the session's fork server first (its preload of distributed, daskdist, torch and Keras is paid once per
pytest session), then ``ProcessWorkers(3)`` forked and ``ProcessWorkers(3, nanny=True)`` through the ``dask
worker`` CLI, alternating, ``ROUNDS`` times each (default 2), and prints each time with the load average.
"""

from __future__ import annotations

import os
import sys
import time

from tests.support.forkserver import forkserver_settings
from tests.support.processes import ProcessWorkers


def main(rounds: int = 2) -> None:
    start = time.monotonic()
    forkserver_settings()
    ProcessWorkers(1).close()
    print(f"fork server start (preload incl. torch, keras) + first worker: {time.monotonic() - start:.1f} s")
    for nanny in (False, True) * rounds:
        start = time.monotonic()
        workers = ProcessWorkers(3, nanny=nanny)
        up = time.monotonic() - start
        workers.close()
        print(f"ProcessWorkers(3, nanny={nanny}): up in {up:.1f} s; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
