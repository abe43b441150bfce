"""Keras 3 on its JAX backend under daskdist's strategies, run in a subprocess with ``KERAS_BACKEND=jax``.

Keras' backend is fixed per process when ``keras`` is imported, and this
pytest process runs the other Keras 3 modules on torch: the module runs
``tests/support/keras3_jax.py`` once, as a user would (``KERAS_BACKEND=jax python
...``; its Dask workers run in that process), with the scenarios of the tests
selected (one JAX and Keras import and one cluster for them all), and each test
checks its scenario's part of the JSON it prints. The reference is always plain
Keras-JAX in that process on the same global batches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from daskdist.plugins import keras3
from tests.support import cpu_profile

# neither is imported here: Keras would fix this process's backend (TensorFlow where KERAS_BACKEND is unset)
# for the other Keras 3 modules collected after this one
if importlib.util.find_spec("jax") is None or importlib.util.find_spec("keras") is None:
    pytest.skip("needs jax and keras (the jax extra)", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parent.parent
RTOL = 1e-5

pytestmark = pytest.mark.timeout(900)


#: Each test's scenario in the module's one subprocess, in the order it runs them (those that share its threaded
#: cluster first, then the elastic scenario's own worker processes, then the matrix cases under pytest).
SCENARIO_OF_TEST = {
    "test_a_find_spec_of_keras_before_its_import_leaves_the_wrapping_to_that_import": "find_spec",
    "test_jax_cnn_fit_evaluate_predict_save_and_batchnorm_equal_plain_keras_jax": "spmd",
    "test_jax_under_central_storage_with_momentum": "held",
    "test_keras3_jax_weights_and_validation_split_equal_plain_keras_jax": "weights",
    "test_jax_elastic_fit_survives_a_worker_killed_mid_epoch_with_the_uninterrupted_weights": "elastic",
    "test_the_matrix_modules_keras3_jax_cases_pass_on_jax": "matrix",
}


@pytest.fixture(scope="module")
def jax_scenarios(request, tmp_path_factory) -> dict:
    """The selected tests' scenarios, run in one ``KERAS_BACKEND=jax`` subprocess: its JSON's ``scenarios``."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    names = [name for test, name in SCENARIO_OF_TEST.items() if test in selected]
    env = {**os.environ, "KERAS_BACKEND": "jax",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(cpu_profile.LOG_ENV, None)  # the matrix cases' own lines would land in this module's log
    done = subprocess.run([sys.executable, "-m", "tests.support.keras3_jax", *names,
                           "--workdir", str(tmp_path_factory.mktemp("keras3_jax"))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "jax"
    return result["scenarios"]


def _scenario(results: dict, name: str) -> dict:
    out = results[name]
    assert "error" not in out, out["error"]
    return out


def _assert_equal_to_plain(case: dict, steps: int) -> None:
    for key in ("weights", "loss", "accuracy", "evaluate", "predict"):
        assert case[key] <= RTOL, (key, case)
    assert case["iterations"] == steps


@pytest.mark.slow
def test_jax_cnn_fit_evaluate_predict_save_and_batchnorm_equal_plain_keras_jax(jax_scenarios):
    out = _scenario(jax_scenarios, "spmd")
    # the tutorial's CNN under MirroredStrategy with 2 replicas: 2 epochs of 3 global batches (32, 32, 16)
    assert out["replicas"] == 2
    _assert_equal_to_plain(out["cnn"], steps=6)
    # model.keras: plain Keras on JAX, with no daskdist imported, loads it and predicts what the model did
    assert out["plain_load"]["backend"] == "jax" and out["plain_load"]["predict_abs_diff"] == 0
    # keras.models.load_model in the scope gives a model of the strategy that trains on as plain Keras does
    assert out["loaded_trains_on"] <= RTOL
    # BatchNormalization's moving statistics averaged over the replicas (identical copies); each replica draws
    # its own dropout stream; without dropout, one step's moving mean is plain Keras' for the whole batch
    assert out["bn_dropout"]["replicas_equal"] and out["bn_dropout"]["own_streams"]
    assert out["bn_dropout"]["moving_mean_moved"] and out["bn_dropout"]["moving_mean"] <= RTOL


@pytest.mark.slow
def test_jax_under_central_storage_with_momentum(jax_scenarios):
    out = _scenario(jax_scenarios, "held")
    central = out["central_storage"]
    assert central["weights"] <= RTOL and central["loss"] <= RTOL, central
    # the update ran once per step on the holder (the client's optimizer shows its count), the replicas hold
    # the stored parameters and their own optimizers only counted the steps
    assert central["iterations"] == 6 and central["replica_iterations"] == [6, 6]
    assert central["replicas_hold_the_stored"]


@pytest.mark.slow
def test_keras3_jax_weights_and_validation_split_equal_plain_keras_jax(jax_scenarios):
    """``sample_weight``, ``class_weight`` and ``validation_split`` (``tests/test_fit_sample_weights.py`` has them
    on torch and the built-in layers): the JAX backend's step (two jitted halves) under both strategies, every
    case's weights and history equal to plain Keras-JAX's on the same global batches."""
    result = _scenario(jax_scenarios, "weights")
    assert sorted(result) == ["mirrored", "multi_worker"]
    for kind, cases in result.items():
        assert sorted(cases) == ["class_weight", "sample_weight", "validation_split"]
        for case, got in cases.items():
            assert got["keys"] and got["weights"] <= RTOL and got["history"] <= RTOL, (kind, case, got)


@pytest.mark.slow
def test_the_matrix_modules_keras3_jax_cases_pass_on_jax(jax_scenarios):
    """The fit, custom-loop and parameter-server matrix (``tests/test_matrix_*.py``) on its ``keras3-jax``
    adapter: this process's matrix has Keras 3 on torch (``tests/support/adapters.py``); here they run under
    pytest in the JAX subprocess (``matrix_client``: the replicas are threads of that process), each against the
    numpy reference. The one-replica combinations (default, one_device) are left out on JAX: nothing there is
    distributed. The callbacks module is left out too: the callbacks run on the client, the same code for every
    backend, and its epoch-callbacks case (ModelCheckpoint's HDF5 file and TensorBoard written while the
    replicas are threads of the same process) hung once here with every thread waiting for the GIL, after two
    clean runs."""
    out = _scenario(jax_scenarios, "matrix")
    assert out["exit"] == 0 and out["failed"] == 0, "\n".join(out["failures"])
    # the one-replica combinations left out here (they run on torch): 4 fit + 4 custom loop + 2 ps
    assert out["passed"] == 10 and out["skipped"] == 0, out


@pytest.mark.slow
def test_jax_elastic_fit_survives_a_worker_killed_mid_epoch_with_the_uninterrupted_weights(jax_scenarios):
    out = _scenario(jax_scenarios, "elastic")
    assert out["worker_backends"] == ["jax"] and out["killed"], out
    assert out["replicas"] == [3, 2] and out["victim_gone"]
    (event,) = out["events"]
    assert event["lost"] and event["members"] == 2
    _, epoch, step = event["commit"]
    assert epoch == 0 and 0 < step < 10 and step % 2 == 0  # back to a commit mid-epoch
    assert out["steps"] == [list(range(10))] * 2 and out["rows"] == [True, True]  # every row once per epoch
    # the same weights, logs and Adam step count as plain Keras-JAX on the same global batches
    assert out["weights"] <= RTOL and out["loss"] <= RTOL and out["accuracy"] <= RTOL, out
    assert out["iterations"] == 20


@pytest.mark.slow
def test_a_backend_neither_torch_nor_jax_is_refused_naming_both():
    for backend in ("tensorflow", "numpy", "openvino"):
        with pytest.raises(keras3.UnsupportedBackendError, match="KERAS_BACKEND=torch or KERAS_BACKEND=jax"):
            keras3.check_backend(backend)
    with pytest.raises(keras3.UnsupportedBackendError, match="bound to TensorFlow's own"):
        keras3.check_backend("tensorflow")
    keras3.check_backend("torch")
    keras3.check_backend("jax")
    assert keras3.SUPPORTED_BACKENDS == ("torch", "jax")


def test_a_find_spec_of_keras_before_its_import_leaves_the_wrapping_to_that_import(jax_scenarios):
    """daskdist imported first, then ``importlib.util.find_spec("keras")`` (an availability check that imports
    nothing), then ``import keras``: Keras' classes are wrapped (the one-shot hook was once used up by the check,
    and this test module's own check left the torch modules collected after it with Keras unwrapped). The
    module's JAX subprocess starts so (``tests/support/keras3_jax.py``)."""
    out = _scenario(jax_scenarios, "find_spec")
    assert out["found"] and not out["installed_before"], out
    assert out["installed_after"] and out["backend"] == "jax", out
