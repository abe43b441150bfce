"""examples/keras3_mnist.py, run as a user runs it: the tutorial with real Keras 3 reaches its accuracy target."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "keras3_mnist.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_keras3_tutorial_trains_checkpoints_saves_and_reloads(tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "torch",
           "PYTHONPATH": str(EXAMPLE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "6", "--replicas", "2", "--target", "0.9",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=580)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "Number of devices: 2 (Keras backend: torch)" in out
    assert len(re.findall(r"epoch +\d+: loss [\d.]+ +accuracy [\d.]+", out)) == 6
    assert "Learning rate for epoch 6 is 0.003000" in out
    evaluated = float(re.search(r"Eval accuracy: (0\.\d+)", out).group(1))
    reloaded = [float(a) for a in re.findall(r"eval accuracy (0\.\d+)", out)]
    assert evaluated >= 0.9, out[-2000:]
    assert reloaded == [evaluated, evaluated], out[-2000:]  # the saved file, reloaded without and with the scope
    assert sorted(os.listdir(tmp_path / "training_checkpoints"))[0] == "ckpt_1.weights.h5"
    assert os.listdir(tmp_path / "logs") and (tmp_path / "model.keras").exists()
    assert "OK: test accuracy" in out
