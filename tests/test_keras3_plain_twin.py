"""The Keras 3 tests' "plain" twins, against plain Keras in a process where daskdist was never imported.

Every Keras 3 test compares daskdist with a plain-Keras twin in the pytest process, where importing daskdist
wrapped ``Model.fit``, ``compile`` and ``Optimizer.apply`` (``daskdist/plugins/keras3/hooks.py``). A bug of
those wrappers on the path they leave to Keras would move both sides alike; this fit, in a fresh interpreter
that imports only Keras, would not move.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.keras3_models import compile_model, dense_data, sequential  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: The fit, the same in both processes: SGD with momentum (Optimizer.apply; a wrong gradient scale shows, which
#: Adam would mostly divide away), a metric, 2 epochs of unshuffled batches.
FIT = ("model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), "
       "loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=['accuracy']); "
       "history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)")


def test_the_in_process_twin_trains_as_plain_keras_in_a_process_without_daskdist(tmp_path):
    import keras

    import daskdist  # noqa: F401 (its hooks wrap Keras in this process, as in every Keras 3 test module)

    x, y = dense_data()
    keras.utils.set_random_seed(11)
    model = compile_model(sequential())  # built; its initial weights go to the other process
    start = model.get_weights()
    np.savez(tmp_path / "in.npz", x=x, y=y, **{f"w{i}": w for i, w in enumerate(start)})
    namespace = {"keras": keras, "model": sequential(), "x": x, "y": y}
    namespace["model"].set_weights(start)
    exec(FIT, namespace)  # the in-process twin: plain Keras, daskdist imported
    here, here_loss = namespace["model"].get_weights(), namespace["history"].history["loss"]

    code = ("import os, sys, numpy as np; os.environ['KERAS_BACKEND'] = 'torch'; import keras; "
            "sys.path.insert(0, os.getcwd()); "
            f"d = np.load({str(tmp_path / 'in.npz')!r}); x, y = d['x'], d['y']; "
            "model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation='relu'), "
            "keras.layers.Dense(4)]); "
            "model.set_weights([d[f'w{i}'] for i in range(len(d.files) - 2)]); "
            f"{FIT}; "
            f"np.savez({str(tmp_path / 'out.npz')!r}, loss=np.array(history.history['loss']), "
            "**{f'w{i}': w for i, w in enumerate(model.get_weights())}); "
            "assert 'daskdist' not in sys.modules, 'daskdist was imported'")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(tmp_path), timeout=240)
    out = np.load(tmp_path / "out.npz")
    there = [out[f"w{i}"] for i in range(len(out.files) - 1)]
    assert len(there) == len(here) == 4
    for a, b in zip(here, there, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(here_loss, out["loss"], rtol=1e-6)
    assert not np.allclose(here[0], start[0])  # it trained
