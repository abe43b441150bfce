"""torch.distributed all-reduce with the gloo backend, timed inside the ranks, for ``benchmarks/allreduce.py``.

``run(n, plan)`` starts N subprocesses of this file in worker mode (one rank
each, ``subprocess.Popen``), which meet through a ``file://`` rendezvous in a
temporary directory and run ``dist.all_reduce(tensor, op=SUM)`` on a float32
CPU tensor, timed with the loop of ``_base.time_sizes``. gloo's all-reduce is
in place, so the tensor is refilled with ones before every call (untimed).
Each rank prints its times as one JSON line; the parent takes the maximum
over the ranks per iteration.

Each rank sets ``torch.set_num_threads(1)`` (like daskdist's single-threaded
workers). Between processes on one host gloo talks TCP: the ranks use the
loopback interface (``GLOO_SOCKET_IFNAME=lo`` unless already set).

On separate hosts (``benchmarks/multihost_allreduce.py``): ``rank_prefix(rank)``
is put in front of each rank's command (e.g. ``nsenter`` into the rank's host),
the ranks meet through ``env://`` on ``master`` (``MASTER_ADDR``/``MASTER_PORT``,
rank 0 serves the store) and talk over ``socket_ifname``.

Run alone::

    .venv/bin/python benchmarks/peers/gloo_allreduce.py [--ranks 2 4] [--sizes 4KiB 64MiB]
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

if __name__ == "__main__" and not __package__:  # run as a script: make ``peers`` and ``_common`` importable
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
    standalone_main,
    tail,
    time_sizes,
)

__all__ = ["run"]


def run(n: int, plan: list[SizePlan], timeout: float = 900, *, rank_prefix: Callable[[int], list[str]] | None = None,
        master: tuple[str, int] | None = None, socket_ifname: str | None = None) -> dict:
    """Time ``plan`` on ``n`` gloo ranks.

    ``rank_prefix(rank)``, if given, is the command prefix that starts rank
    ``rank`` (e.g. entering its host's namespaces); ``master`` (address, port)
    makes the ranks meet through ``env://`` there instead of a ``file://``
    rendezvous; ``socket_ifname`` sets ``GLOO_SOCKET_IFNAME``.

    Returns ``{"info": str, "times": {nbytes: [seconds per iteration, max over ranks]}}``.

    Raises
    ------
    PeerUnavailable
        torch is missing, or a rank failed or the run timed out.
    """
    if importlib.util.find_spec("torch") is None:
        raise PeerUnavailable("torch is not installed (pip install torch==2.13.0, the CPU build)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if socket_ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = socket_ifname
    elif "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if master is not None:
        env.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    with tempfile.TemporaryDirectory(prefix="gloo-bench-") as tmp:
        init_method = "env://" if master is not None else "file://" + os.path.join(tmp, "rendezvous")
        plan_json = plan_to_json(plan)
        outputs = [(open(os.path.join(tmp, f"out-{r}"), "w+"), open(os.path.join(tmp, f"err-{r}"), "w+"))
                   for r in range(n)]
        procs = [
            subprocess.Popen(
                [*(rank_prefix(rank) if rank_prefix else []), sys.executable, os.path.abspath(__file__), "--worker",
                 str(rank), str(n), init_method, plan_json],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, text=True,
            )
            for rank, (out, err) in enumerate(outputs)
        ]
        try:
            failure = _wait_all(procs, time.monotonic() + timeout)
            texts = []
            for out, err in outputs:
                out.seek(0)
                err.seek(0)
                texts.append((out.read(), err.read()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for out, err in outputs:
                out.close()
                err.close()
    if failure is not None:
        rank, what = failure
        raise PeerUnavailable(f"gloo rank {rank} {what}: {tail(texts[rank][1] + texts[rank][0])}")
    try:
        results = [parse_result(out) for out, _ in texts]
    except ValueError:
        raise PeerUnavailable(f"a gloo rank printed no result: {tail(texts[0][1])}") from None
    return {
        "info": f"torch {results[0]['torch']}, gloo over TCP ({env.get('GLOO_SOCKET_IFNAME', 'default interface')}), "
                f"{n} subprocesses, torch.set_num_threads(1)"
                + (f", env:// rendezvous on {master[0]}:{master[1]}" if master is not None else ""),
        "times": per_iteration_max([r["times"] for r in results]),
        "walls": max_walls([r["walls"] for r in results]),
    }


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> tuple[int, str] | None:
    """Wait for every rank; on the first failure or at the deadline kill the rest. Returns (rank, what) or None."""
    while True:
        running = False
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0:
                return rank, f"exited with {code}"
        if not running:
            return None
        if time.monotonic() > deadline:
            return next(r for r, p in enumerate(procs) if p.poll() is None), "did not finish in time"
        time.sleep(0.05)


def _worker(rank: int, world_size: int, init_method: str, plan_json: str) -> None:
    """One gloo rank: time the plan and print this rank's times."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    expected = float(world_size)

    def setup(nbytes: int) -> torch.Tensor:
        return torch.ones(nbytes // 4, dtype=torch.float32)

    def before(tensor: torch.Tensor) -> None:
        tensor.fill_(1.0)

    def allreduce(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def check(tensor: torch.Tensor) -> None:
        for i in (0, -1, tensor.numel() // 2):
            if float(tensor[i]) != expected:
                raise AssertionError(f"all_reduce gave {float(tensor[i])}, expected {expected}")

    walls: dict[str, float] = {}
    try:
        times = time_sizes(plan_from_json(plan_json), setup, allreduce, check, before=before, walls=walls)
    finally:
        dist.destroy_process_group()
    print(RESULT_MARKER + json.dumps({"rank": rank, "torch": torch.__version__, "times": times, "walls": walls}),
          flush=True)


def main(argv: list[str] | None = None) -> None:
    """Worker mode (``--worker RANK WORLD INIT PLAN``, started by ``run``) or the stand-alone command line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(int(argv[1]), int(argv[2]), argv[3], argv[4])
        return
    standalone_main(
        "torch.distributed (gloo) float32 SUM all_reduce, timed inside the ranks",
        lambda n, plan, args: run(n, plan),
        argv,
    )


if __name__ == "__main__":
    main()
