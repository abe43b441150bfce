"""examples/torch_ddp.py, run as a user runs it: stock DDP on the daskdist backend learns the digits."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "torch_ddp.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_the_torch_ddp_example_trains_equal_replicas_to_a_useful_accuracy():
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--replicas", "2", "--epochs", "4"], capture_output=True,
                          text=True, env=env, timeout=380)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "Number of devices: 2" in out
    losses = [float(v) for v in re.search(r"loss per epoch: (.*)", out).group(1).split(", ")]
    assert len(losses) == 4 and losses[-1] < losses[0], out
    accuracy = float(re.search(r"test accuracy ([\d.]+)", out).group(1))
    assert accuracy > 0.7, out  # 4 short epochs on 1,437 digits; 10 classes: chance is 0.1
