"""Helpers shared by the benchmark scripts: environment header, statistics, tables, clusters."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import shlex
import sys
from typing import Iterator, Sequence

import numpy as np

__all__ = [
    "command_line",
    "environment_lines",
    "format_table",
    "local_cluster",
    "percentile_ms",
    "print_header",
]


def command_line() -> str:
    """The command that started this process, with the interpreter path relative to the cwd when inside it."""
    exe = sys.executable
    rel = os.path.relpath(exe)
    if not rel.startswith(".."):
        exe = rel
    return shlex.join([exe, *sys.argv])


def environment_lines() -> list[str]:
    """A few lines describing the machine and the library versions."""
    import dask
    import distributed

    import daskdist

    return [
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"host: {platform.node()}  cpus: {os.cpu_count()}  python: {platform.python_version()}",
        f"daskdist {daskdist.__version__}  dask {dask.__version__}  distributed {distributed.__version__}  "
        f"numpy {np.__version__}",
    ]


def print_header(title: str) -> None:
    """Print the exact command line, a title and the environment."""
    print(f"$ {command_line()}")
    print(title)
    for line in environment_lines():
        print(line)
    print(flush=True)


def percentile_ms(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (seconds) in milliseconds."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) * 1e3


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown pipe table with right-aligned columns (readable as plain text too)."""
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for row in cells[1:]:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def local_cluster(n_workers: int) -> Iterator[object]:
    """A ``Client`` on a fresh ``LocalCluster`` of ``n_workers`` single-threaded processes; closed on exit."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",
        silence_logs=logging.ERROR,
    )
    try:
        client = Client(cluster)
        try:
            client.wait_for_workers(n_workers)
            yield client
        finally:
            client.close()
    finally:
        cluster.close()
