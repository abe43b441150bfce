"""The small model and data sets the elastic tests share (daskdist's Keras API)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

import daskdist as dd
from daskdist import keras

Dataset = dd.data.Dataset

#: the ring all-reduce, whose two halves are fault-point phases
RING = dd.CommunicationOptions(implementation="RING")


def slow_batch(*batch):
    """An after-batch map that makes each step take a while, so a step-placed kill lands mid-epoch.

    In the workers of a ``ProcessWorkers`` set it sleeps only while the set's slow-steps switch is on
    (``ProcessWorkers.slow_steps``: a kill at a step turns it off once it landed); elsewhere always.
    """
    switch = os.environ.get("DASKDIST_TEST_SLOW_FILE")  # support.processes.SLOW_FILE_ENV
    if switch is None or os.path.exists(switch):
        time.sleep(0.12)
    return batch


def data(n=240, features=4, seed=0):
    """``n`` rows of ``features`` floats in [0, 1) and labels in {0, 1, 2}, from ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.random((n, features)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)


def model(weights=None, optimizer: str = "adam"):
    """A 4 -> 8 -> 3 classifier with Adam(0.01) (``optimizer="sgd"``: SGD(0.5)), built, with ``weights`` if given.

    Adam divides a gradient by its running scale, so a gradient off by a factor moves its weights only a
    little; under SGD the same bug moves them by that factor.
    """
    made = keras.Sequential([keras.layers.Dense(8, activation="relu", input_shape=(4,)), keras.layers.Dense(3)])
    chosen = keras.optimizers.Adam(0.01) if optimizer == "adam" else keras.optimizers.SGD(0.5)
    made.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 optimizer=chosen, metrics=["accuracy"])
    made.build((4,))
    if weights is not None:
        made.set_weights(weights)
    return made


def train_set():
    """240 rows in batches of 24: 10 steps per epoch."""
    x, y = data(240)
    return Dataset.from_tensor_slices((x, y)).batch(24)


def resolver_view(service):
    """(task type, task id) and the selected workers of a replica's cluster resolver (``group.call``)."""
    resolver = service.strategy_view.cluster_resolver
    return (resolver.task_type, resolver.task_id), list(resolver.selector)


@dataclass(frozen=True)
class OneProcessRun:
    """What ``one_process_fit`` trained: the weights after it and its epoch logs (``History.history``)."""

    weights: list[np.ndarray]
    history: dict[str, list[float]]


def one_process_fit(weights, dataset, epochs: int, optimizer: str = "adam") -> OneProcessRun:
    """The reference of an elastic test: ``model(weights)`` fit ``epochs`` on ``dataset`` in this process.

    No strategy and no worker: the same global batches through one model, independent of the replicas,
    commits, restores and all-reduces under test (a few milliseconds, where a reference fit on the test's
    workers took seconds).
    """
    reference = model(weights, optimizer)
    history = reference.fit(dataset, epochs=epochs, verbose=0)
    return OneProcessRun(reference.get_weights(), dict(history.history))


def _replica_weights(service) -> list[list[np.ndarray]]:
    from daskdist.group.service import MODEL

    return [[np.array(w) for w in service.objects.get(MODEL, model_id).model.get_weights()]
            for model_id in sorted(service.objects.ids(MODEL))]


def assert_replicas_hold_the_same_weights(strategy) -> None:
    """Every replica's copy of every model the strategy's replicas hold equals replica 0's, bit for bit."""
    held = strategy.extended.run_on_replicas(_replica_weights)
    assert held[0], "the replicas hold no model"
    for rank, models_of_rank in enumerate(held[1:], start=1):
        assert len(models_of_rank) == len(held[0]), rank
        for mine, first in zip(models_of_rank, held[0], strict=True):
            for a, b in zip(mine, first, strict=True):
                assert np.array_equal(a, b), f"replica {rank} holds other weights than replica 0"
