"""The elastic example, run as a user runs it: a worker process killed mid-fit, training finishes."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "elastic_mnist.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_elastic_example_survives_a_killed_worker_and_commits_every_row_of_every_epoch_once():
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "4"], capture_output=True, text=True,
                          env=env, timeout=280)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "killing worker" in out
    assert re.search(r"generation 1: restored, 2 replicas \(lost \['tcp://", out), out
    epochs = re.findall(r"epoch +\d+: loss [\d.]+, (\d+) rows committed \((\d+) distinct of (\d+)\)", out)
    assert len(epochs) == 4
    assert all(rows == distinct == total for rows, distinct, total in epochs), epochs
