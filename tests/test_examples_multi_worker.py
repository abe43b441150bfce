"""examples/multi_worker.py against a cluster started as a user starts one: ``dask scheduler`` + ``dask worker``.

The scheduler and the workers are separate processes started with Dask's own
command line; they import daskdist from this checkout (PYTHONPATH), as an
installed daskdist would be on a real cluster. The example runs as a script
with ``--scheduler ADDRESS`` and must train to its accuracy target.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

pytest.importorskip("sklearn")

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "multi_worker.py"
DASK = pathlib.Path(sys.executable).with_name("dask")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not happen within {timeout} s")


@pytest.fixture
def user_cluster(tmp_path):
    """``dask scheduler`` and two ``dask worker`` processes (one thread each); stopped afterwards."""
    if not DASK.exists():
        pytest.skip(f"no `dask` command beside {sys.executable}")
    scheduler_file = tmp_path / "scheduler.json"
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("scheduler", "worker-0", "worker-1")]  # noqa: SIM115
    common = {"env": _env(), "cwd": tmp_path, "stderr": subprocess.STDOUT}
    processes = [subprocess.Popen([str(DASK), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                   "--dashboard-address", ":0", "--scheduler-file", str(scheduler_file)],
                                  stdout=logs[0], **common)]
    try:
        address = _wait_for(lambda: scheduler_file.exists() and json.loads(scheduler_file.read_text() or "{}")
                            .get("address"), 60, "the scheduler's start")
        for i in range(2):
            processes.append(subprocess.Popen([str(DASK), "worker", address, "--nthreads", "1", "--name", f"w{i}",
                                               "--no-dashboard", "--memory-limit", "0"], stdout=logs[i + 1],
                                              **common))
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
        yield address
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in reversed(processes):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in logs:
            log.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multi_worker_example_runs_against_an_existing_cluster(user_cluster):
    run = subprocess.run([sys.executable, str(EXAMPLE), "--scheduler", user_cluster, "--epochs", "6"],
                         env=_env(), capture_output=True, text=True, timeout=540)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "replicas in sync: 2" in output, output
    assert "custom loop: mean loss" in output, output
    accuracy = float(output.split("held-out accuracy ")[1].split()[0])
    assert accuracy >= 0.9, output
