"""``make gpu-check``: every GPU test and a short NCCL all-reduce benchmark, in one command, in about 8 minutes.

On a machine with an NVIDIA GPU, from a fresh clone: installs the ``gpu``,
``torch`` and ``keras`` extras (and pytest) into the venv, runs every test
marked ``gpu`` (cupy arrays, the NCCL engine, DDP on CUDA tensors through the
store rendezvous, SyncBatchNorm on CUDA, a Keras 3 model on CUDA) and
``benchmarks/gpu_allreduce.py`` (daskdist's NCCL engine against torch's own
NCCL backend), each under a time limit, and prints one table. Without a GPU
it says so and exits 0 before installing anything.

    python scripts/gpu_check.py [--venv .venv] [--budget 480]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = ["tests/test_gpu.py", "tests/test_nccl.py", "tests/test_gpu_torch.py",
             "tests/test_torch_backend.py::test_cuda_tensors_go_through_nccl"]


def gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none without the driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.splitlines() if line.startswith("GPU ")]


def _run(command: list[str], timeout: float, **kwargs) -> tuple[int, float]:
    start = time.monotonic()
    try:
        code = subprocess.run(command, cwd=ROOT, timeout=max(timeout, 1), **kwargs).returncode
    except subprocess.TimeoutExpired:
        code = 124
    return code, time.monotonic() - start


def _test_rows(junit: Path) -> list[tuple[str, str, str]]:
    """(test, outcome, detail) for each test case of a JUnit XML report."""
    rows = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[kind]
                detail = (found.get("message") or "").splitlines()[0][:70] if found.get("message") else ""
                break
        rows.append((name, outcome, detail))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="daskdist's GPU check")
    parser.add_argument("--venv", default=".venv")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check (default 480)")
    args = parser.parse_args(argv)
    found = gpus()
    if not found:
        print("gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing to check.")
        return 0
    deadline = time.monotonic() + args.budget
    venv = ROOT / args.venv
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install, install_s = _run([str(python), "-m", "pip", "install", "--quiet", "-e", ".[gpu,torch,keras]",
                               "pytest>=8", "pytest-timeout>=2.3"], timeout=deadline - time.monotonic() - 200)
    if install:
        print(f"gpu-check: installing the gpu extra failed (exit {install})")
        return install
    probe = subprocess.run([str(python), "-c", "import torch, cupy; print(torch.__version__, torch.cuda.is_available(), "
                            "cupy.cuda.runtime.getDeviceCount())"], cwd=ROOT, capture_output=True, text=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    junit = work / "tests.xml"
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    tests, tests_s = _run([str(python), "-m", "pytest", *GPU_TESTS, "-k", "gpu or cuda", "-q", "-p", "no:randomly",
                           "--timeout", "120", f"--junitxml={junit}"], timeout=deadline - time.monotonic() - 90,
                          env=env)
    bench_json = work / "bench.json"
    bench, bench_s = _run([str(python), "benchmarks/gpu_allreduce.py", "--json", str(bench_json)],
                          timeout=deadline - time.monotonic(), env=env, capture_output=True, text=True)
    rows = _test_rows(junit) if junit.exists() else []
    print()
    print(f"daskdist gpu-check on {len(found)} GPU(s): {found[0]}")
    print(f"torch / cuda available / cupy devices: {probe.stdout.strip() or probe.stderr.strip()[-200:]}")
    print(f"install {install_s:.0f} s, tests {tests_s:.0f} s (exit {tests}), benchmark {bench_s:.0f} s (exit {bench})")
    print(f"{'test':<78} {'outcome':<8} detail")
    for name, outcome, detail in rows:
        print(f"{name[:78]:<78} {outcome:<8} {detail}")
    if bench_json.exists():
        print(f"\n{'all-reduce bytes':>16} {'daskdist NCCL us':>17} {'torch NCCL us':>14} {'torch/daskdist':>15}")
        for row in json.loads(bench_json.read_text()):
            print(f"{row['bytes']:>16} {row['daskdist_us']:>17.1f} {row['torch_nccl_us']:>14.1f} {row['ratio']:>15.2f}")
    else:
        print(f"\nbenchmark: no figures (exit {bench})")
    counts = {o: sum(1 for _, outcome, _ in rows if outcome == o) for o in ("passed", "FAILED", "ERROR", "skipped")}
    print(f"\n{counts['passed']} passed, {counts['FAILED'] + counts['ERROR']} failed, {counts['skipped']} skipped")
    return 0 if tests == 0 and bench == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
