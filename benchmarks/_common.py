"""Helpers shared by the benchmark scripts: environment header, statistics, tables, clusters."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "add_transport_option",
    "alternating_rounds",
    "check_worker_settings",
    "command_line",
    "config_overrides",
    "blas_in_use",
    "environment_lines",
    "format_table",
    "local_cluster",
    "namespace_cluster",
    "percentile_ms",
    "print_header",
    "settings",
    "settings_line",
]

T = TypeVar("T")

#: The daskdist settings that change what the benchmarks measure; printed, and checked on the workers.
SETTINGS = ("collective.transport", "metrics.log-events")


def command_line() -> str:
    """The command that started this process, with the interpreter path relative to the cwd when inside it.

    A ``PYTHONPATH`` (e.g. pointing at a clean checkout of daskdist) is shown in front.
    """
    exe = sys.executable
    rel = os.path.relpath(exe)
    if not rel.startswith(".."):
        exe = rel
    command = shlex.join([exe, *sys.argv])
    if os.environ.get("PYTHONPATH"):
        command = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} {command}"
    return command


def library_revision() -> str:
    """The git commit of the daskdist source in use, with ``+dirty`` if ``daskdist/`` has local changes."""
    import daskdist

    root = os.path.dirname(os.path.dirname(os.path.abspath(daskdist.__file__)))
    try:
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "daskdist"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return commit + ("+dirty" if status else "")


def environment_lines() -> list[str]:
    """A few lines describing the machine and the library versions."""
    import dask
    import distributed

    import daskdist

    return [
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"host: {platform.node()}  cpus: {os.cpu_count()}  python: {platform.python_version()}",
        f"daskdist {daskdist.__version__}  dask {dask.__version__}  distributed {distributed.__version__}  "
        f"numpy {np.__version__}  daskdist source: {library_revision()}",
        f"BLAS: {blas_in_use()}  (OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '-')})",
    ]


def blas_in_use() -> str:
    """The BLAS libraries numpy loaded, their kernel (architecture) and threads (threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl missing)"
    found = [f"{i['internal_api']} {i.get('version', '')} {i.get('architecture', '?')} x{i['num_threads']}"
             for i in threadpool_info() if i["user_api"] == "blas"]
    return ", ".join(found) or "none loaded"


def print_header(title: str) -> None:
    """Print the exact command line, a title and the environment."""
    print(f"$ {command_line()}")
    print(title)
    for line in environment_lines():
        print(line)
    print(flush=True)


def add_transport_option(parser: object) -> None:
    """``--transport NAME``: set ``daskdist.collective.transport`` for the whole run."""
    parser.add_argument(
        "--transport",
        default=None,
        help="daskdist.collective.transport for this run (e.g. dask); default: the configured value",
    )


def config_overrides(transport: str | None, extra: dict[str, object] | None = None) -> dict[str, object]:
    """A ``dask.config.set`` mapping: ``extra`` (keys relative to ``daskdist.``) and the transport if given."""
    overrides = {f"daskdist.{key}": value for key, value in (extra or {}).items()}
    if transport is not None:
        overrides["daskdist.collective.transport"] = transport
    return overrides


def settings_line() -> str:
    """The ``SETTINGS`` as one printable line."""
    return "  ".join(f"daskdist.{key}: {value}" for key, value in settings().items())


def settings() -> dict[str, object]:
    """The current values of ``SETTINGS`` (``daskdist.`` keys) in this process."""
    import daskdist  # noqa: F401  (registers the daskdist defaults)
    from daskdist import config

    return {key: config.get(key) for key in SETTINGS}


def check_worker_settings(client: object) -> None:
    """Raise if a worker sees other daskdist ``SETTINGS`` than this process (they must inherit them).

    Call it once a strategy exists on the cluster, so that the workers have
    imported daskdist (and registered its defaults).
    """
    import dask.config

    mine = settings()
    for key in SETTINGS:
        seen = client.run(dask.config.get, f"daskdist.{key}", None)
        for address, value in seen.items():
            if value != mine[key]:
                raise RuntimeError(f"worker {address} sees daskdist.{key}={value!r}, the client {mine[key]!r}")


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
    import dask
    from distributed import Client, LocalCluster

    from daskdist.cluster.embedded import worker_environment_config

    with dask.config.set(worker_environment_config()):  # the worker environment of daskdist's embedded cluster
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


@contextlib.contextmanager
def namespace_cluster(n_hosts: int, per_host: int, rate: str = "10gbit") -> Iterator[tuple[Any, Any]]:
    """Namespace hosts with their Dask workers (``tests/netns.py``) and a ``Client``: ``(hosts, client)``.

    ``n_hosts`` hosts, ``per_host`` single-threaded workers each, every link
    shaped to ``rate``; the hosts are printed, and everything (processes,
    namespaces, links) is removed on exit, also on an error or Ctrl-C. Ends
    the program with the reason when namespace hosts cannot be made here
    (they need Linux, root and iproute2).
    """
    from distributed import Client

    from tests.netns import start_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot make namespace hosts here: {reason}")
    hosts = start_hosts(n_hosts, per_host, rate=rate)
    try:
        print(f"namespace hosts: {', '.join(f'{h.hostname} {h.address} ({h.namespace})' for h in hosts.hosts)}, "
              f"bridge {hosts.bridge}, links {rate}", flush=True)
        with Client(hosts.scheduler_address, set_as_default=False) as client:
            client.wait_for_workers(n_hosts * per_host, timeout=120)
            yield hosts, client
    finally:
        hosts.close()


def alternating_rounds(arms: Sequence[str], rounds: int, block: Callable[[str], T],
                       show_load: bool = False) -> dict[str, list[T]]:
    """``rounds`` rounds of one ``block(arm)`` per arm, the order rotating each round; the results per arm.

    Three arms run A B C, B C A, C A B, ...; two arms A B, B A (ABBA), so a
    drift of the machine over time falls on every arm alike. ``show_load``:
    print the load average before each block (the figures of a loaded machine
    must say so) and the block's result after it.
    """
    results: dict[str, list[T]] = {arm: [] for arm in arms}
    names = list(arms)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for arm in names[shift:] + names[:shift]:
            load = os.getloadavg()
            results[arm].append(block(arm))
            if show_load:
                print(f"round {round_ + 1} {arm}: {results[arm][-1]} (load before: "
                      f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f})", flush=True)
    return results


def alternating_arm_times(arms: dict[str, Callable[[], object]], steps: int, per: int = 4, warm_up: int = 8,
                          after: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each arm, in one process: ``warm_up`` calls each, then ``steps`` alternations (the arms'
    order reversed every other one, so a drift falls on all alike) of ``per`` calls per arm (so that the next
    calls' cache misses count); ``after`` runs at the end of each timing and counts in it (a last copy's wait)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for arm in arms.values():
        for _ in range(warm_up):
            arm()
    for n in range(steps):
        for name in (order if n % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            for _ in range(per):
                arms[name]()
            if after is not None:
                after()
            times[name].append((time.perf_counter() - start) / per)
    return times


def arm_times_table(times: dict[str, list[float]], base: str = "plain step") -> str:
    """Each arm's median ms per call and its ratio to ``base``'s."""
    reference = statistics.median(times[base])
    return format_table(["arm", "ms per step (median)", "ratio to the plain step"],
                        [[name, f"{statistics.median(t) * 1e3:.2f}", f"{statistics.median(t) / reference:.3f}"]
                         for name, t in times.items()])
