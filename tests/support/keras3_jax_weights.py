"""``sample_weight``, ``class_weight`` and ``validation_split`` of Keras 3 on its JAX backend, against plain Keras-JAX.

The ``weights`` scenario of ``tests/support/keras3_jax.py`` (``tests/test_keras3_jax.py`` runs it in its JAX
subprocess: Keras fixes its backend per process). ``cases(client)`` gives, for each strategy and argument, the
largest relative difference of the weights and of every history key from plain Keras-JAX in this process on the
same global batches.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

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


def cases(client) -> dict:
    """Each case under MirroredStrategy (2 replicas) and MultiWorkerMirroredStrategy on ``client``'s workers."""
    x, y = dense_data(rows=96)
    position = np.arange(96) % BATCH
    w = np.where(position < 10, 0.2, np.where(position < 21, 5.0, 1.0)).astype(np.float32)
    arguments_of = {"sample_weight": dict(sample_weight=w, validation_data=(x, y, w)),
                    "class_weight": dict(class_weight=CLASS_WEIGHT),
                    "validation_split": dict(sample_weight=w, validation_split=0.25)}
    result: dict = {}
    for name, make in (("mirrored", lambda: dd.MirroredStrategy(["/cpu:0", "/cpu:1"], client=client)),
                       ("multi_worker", lambda: dd.MultiWorkerMirroredStrategy(client=client))):
        with make() as strategy:
            result[name] = {case: _case(strategy, x, y, arguments) for case, arguments in arguments_of.items()}
    return result
