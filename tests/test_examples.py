"""Every example in ``examples/`` run as a user runs it: ``python examples/<name>.py``, in its own process.

``elastic_mnist.py`` runs in ``test_elastic_example.py`` (a worker killed mid-fit), ``dataframe_regression.py``
in ``test_dataframe_input.py``, ``multi_worker.py`` in ``test_examples_multi_worker.py`` (against ``dask
scheduler`` and ``dask worker`` processes) and ``tutorial.ipynb`` in ``test_notebook.py``; the others run here with
fewer epochs or steps than their defaults, each starting its own embedded cluster as it does for a user.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.timeout(300)


def _run(name: str, *args: str, cwd=None) -> str:
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, env=env,
                          timeout=280, cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_every_example_has_a_test():
    tested = {"quickstart.py", "mnist_mirrored.py", "parameter_server.py", "pytorch_plugin.py",  # here
              "elastic_mnist.py", "dataframe_regression.py", "multi_worker.py", "tutorial.ipynb",  # their own files
              "keras3_mnist.py", "torch_ddp.py"}  # tests/install_routes/routes.py (keras route), test_torch_example.py
    assert {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".ipynb") and not p.name.startswith("_")} == tested
    # the examples' shared modules: the tutorial's data (mnist_mirrored.py, keras3_mnist.py)
    assert {p.name for p in EXAMPLES.glob("_*.py")} == {"_digits.py"}


def test_quickstart_reduces_and_gathers_and_closes_its_cluster():
    out = _run("quickstart.py", "--replicas", "2")
    assert "Replicas in sync: 2" in out
    assert "reduce MEAN ->" in out and "gather axis 0 ->" in out
    assert out.rstrip().endswith("OK: strategy closed, embedded cluster shut down")


def test_mnist_mirrored_trains_saves_and_reloads(tmp_path):
    out = _run("mnist_mirrored.py", "--epochs", "3", "--replicas", "2", "--verbose", "0",
               "--workdir", str(tmp_path), "--target", "0.8")
    assert "Number of devices: 2" in out
    assert re.search(r"Reloaded in the scope \(2 replicas\)", out), out
    assert re.search(r"OK: test accuracy 0\.\d+ \(target 0\.8\)", out), out


def test_the_parameter_server_example_trains_asynchronously_and_reads_each_partition_once():
    out = _run("parameter_server.py", "--steps", "400", "--target", "0.6")
    assert "partitions read by each worker" in out and "data ledger, first pass:" in out
    assert re.search(r"OK: test accuracy 0\.\d+ \(target 0\.6\)", out), out


def test_the_pytorch_plugin_example_keeps_the_copies_equal_and_learns():
    pytest.importorskip("torch")  # in the test extra: this skips only outside it
    out = _run("pytorch_plugin.py", "--epochs", "5")
    found = re.search(r"(\d+) replicas, test accuracy ([\d.]+)", out)
    assert found, out
    assert int(found.group(1)) >= 2 and float(found.group(2)) > 0.8, out
