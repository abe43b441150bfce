"""``sample_weight``, ``class_weight`` and ``validation_split`` of Keras 3 on its JAX backend, against plain Keras-JAX.

Run by ``tests/test_fit_sample_weights.py`` in a subprocess (Keras fixes its
backend per process): ``KERAS_BACKEND=jax python -m tests.support.keras3_jax_weights``.
It prints one JSON line: for each strategy and argument, the largest relative
difference of the weights and of every history key from plain Keras-JAX in
this process on the same global batches.
"""

from __future__ import annotations

import json
import logging
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

import daskdist as dd  # noqa: E402
from tests.keras3_models import assert_replicas_identical, dense_data, sequential  # noqa: E402
from tests.support.closeness import max_rel  # noqa: E402

BATCH = 32
CLASS_WEIGHT = {0: 0.5, 1: 3.0, 2: 1.0, 3: 7.0}


def _compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def _case(strategy, x, y, arguments) -> dict:
    with strategy.scope():
        model = _compiled(sequential())
    plain = sequential()
    plain.set_weights(model.get_weights())
    _compiled(plain)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **arguments)
    expected = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **arguments)
    assert_replicas_identical(strategy, model)
    return {"weights": max_rel(model.get_weights(), plain.get_weights()),
            "keys": sorted(history.history) == sorted(expected.history),
            "history": max(max_rel(history.history[k], expected.history[k]) for k in expected.history)}


def main() -> None:
    x, y = dense_data(rows=96)
    position = np.arange(96) % BATCH
    w = np.where(position < 10, 0.2, np.where(position < 21, 5.0, 1.0)).astype(np.float32)
    cases = {"sample_weight": dict(sample_weight=w, validation_data=(x, y, w)),
             "class_weight": dict(class_weight=CLASS_WEIGHT),
             "validation_split": dict(sample_weight=w, validation_split=0.25)}
    result: dict = {}
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster, set_as_default=False) as client:
        for name, make in (("mirrored", lambda: dd.MirroredStrategy(["/cpu:0", "/cpu:1"], client=client)),
                           ("multi_worker", lambda: dd.MultiWorkerMirroredStrategy(client=client))):
            with make() as strategy:
                result[name] = {case: _case(strategy, x, y, arguments) for case, arguments in cases.items()}
    result["backend"] = keras.backend.backend()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
