"""``python -m daskdist.torchrun``: a DDP script written for torchrun, unchanged, on the shared cluster's 2 workers.

The script (``tests/scripts/torchrun_ddp.py``) initialises ``torch.distributed``
itself (``init_process_group()`` through ``env://``, or a named backend),
trains with DDP and a ``DistributedSampler`` and writes each rank's parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from daskdist import torchrun

pytest.importorskip("torch")

SCRIPT = str(Path(__file__).parent / "scripts" / "torchrun_ddp.py")


def _parameters(out: Path, rank: int) -> list[np.ndarray]:
    return [np.asarray(p) for p in json.loads(Path(f"{out}.{rank}").read_text())]


def _scheduler(client) -> str:
    return client.scheduler.address


def test_an_unmodified_torchrun_script_trains_with_equal_parameters_on_both_ranks(process_client, tmp_path):
    """The real command line; init_process_group() (gloo through torchrun's agent store), rank 0's output back."""
    out = tmp_path / "params"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "daskdist.torchrun", "--scheduler", _scheduler(process_client),
                           SCRIPT, "--out", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["rank 0 of 2 trained on ProcessGroupGloo"], (done.stdout, done.stderr)
    for a, b in zip(_parameters(out, 0), _parameters(out, 1)):
        np.testing.assert_array_equal(a, b)


def test_the_daskdist_backend_by_name_and_every_ranks_output(process_client, tmp_path, capsys):
    out = tmp_path / "params"
    code = torchrun.main(["--scheduler", _scheduler(process_client), "--output-ranks", "all", SCRIPT,
                          "--backend", "daskdist", "--out", str(out)])
    assert code == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == ["[rank0]:rank 0 of 2 trained on daskdist", "[rank1]:rank 1 of 2 trained on daskdist"]
    for a, b in zip(_parameters(out, 0), _parameters(out, 1)):
        np.testing.assert_array_equal(a, b)


def test_a_failing_rank_fails_the_run_with_its_traceback_and_the_exit_status_is_the_scripts(
        process_client, tmp_path, capsys):
    address = _scheduler(process_client)
    code = torchrun.main(["--scheduler", address, SCRIPT, "--out", str(tmp_path / "p"), "--fail-rank", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "rank 1 (worker" in err and "failed with exit code 1" in err, err
    assert "Traceback" in err and "ValueError: rank 1 fails on purpose" in err, err
    assert torchrun.main(["--scheduler", address, SCRIPT, "--out", str(tmp_path / "q"), "--exit-code", "3"]) == 3


def test_bad_options_are_refused_clearly():
    with pytest.raises(SystemExit):
        torchrun.parse_args(["--scheduler", "tcp://x:1", "--nproc-per-worker", "2", "s.py"])
    with pytest.raises(SystemExit):
        torchrun.parse_args(["--scheduler", "tcp://x:1", "--nnodes", "3:2", "s.py"])
    args = torchrun.parse_args(["--scheduler", "tcp://x:1", "--nnodes", "2:4", "--max-restarts", "1", "s.py", "--lr",
                                "0.1"])
    assert (args.min_workers, args.max_workers, args.max_restarts) == (2, 4, 1)
    assert args.script == "s.py" and args.script_args == ["--lr", "0.1"] and args.output == [0]


def test_a_failure_is_run_again_up_to_max_restarts(process_client, tmp_path, capsys):
    """torchrun's --max-restarts: rank 1 fails on the first attempt only (TORCHELASTIC_RESTART_COUNT 0)."""
    out = tmp_path / "params"
    code = torchrun.main(["--scheduler", _scheduler(process_client), "--max-restarts", "1", SCRIPT, "--out", str(out),
                          "--fail-rank", "1", "--fail-once"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "ValueError: rank 1 fails on purpose" in err and "restarting (1 of 1)" in err, err
    for a, b in zip(_parameters(out, 0), _parameters(out, 1)):
        np.testing.assert_array_equal(a, b)


def test_ctrl_c_stops_every_rank(process_client, tmp_path):
    out = tmp_path / "held"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-m", "daskdist.torchrun", "--scheduler", _scheduler(process_client),
                                 SCRIPT, "--out", str(out), "--hold", "300"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while not all(Path(f"{out}.ready.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, stderr
    assert "interrupted, stopping every rank" in stderr
    assert all(Path(f"{out}.interrupted.{r}").exists() for r in (0, 1))  # KeyboardInterrupt in each rank's script
