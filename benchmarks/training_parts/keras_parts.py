"""Parts 1 and 2 of the training benchmark: the tutorial's CNN trained with ``fit``.

* ``synthetic_mnist``: MNIST-shaped data (28x28x1 uint8 images, 10 classes).
* ``tutorial_pipeline``: the tutorial's input pipeline over Dask arrays on the cluster.
* ``build_cnn``: the tutorial's model, compiled as the tutorial compiles it.
* ``bare_block``: runs on a replica (``strategy.run``): the same model's math,
  step by step, with the calls ``daskdist/keras/training.py`` makes but none of
  the framework around them (no input pipeline, no all-reduce, no step timer).
* ``EpochTimer`` / ``Turns``: epoch hooks that time epochs on the client and let
  two ``fit`` calls (in two threads) take turns epoch by epoch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import daskdist as dd
from daskdist import keras

IMAGE_SHAPE = (28, 28, 1)
CLASSES = 10
SHUFFLE_BUFFER = 10_000
PARTITIONS = 8


def synthetic_mnist(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``samples`` random 28x28x1 uint8 images and int64 labels in [0, 10)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (samples, *IMAGE_SHAPE), dtype=np.uint8)
    labels = rng.integers(0, CLASSES, samples).astype(np.int64)
    return images, labels


def scale(image: Any, label: Any) -> tuple[Any, Any]:
    return (image / np.float32(255.0)).astype(np.float32), label


def persist_on_cluster(client: Any, images: np.ndarray, labels: np.ndarray) -> tuple[Any, Any]:
    """The arrays as Dask arrays of ``PARTITIONS`` row chunks, persisted on the cluster's workers."""
    import dask.array as da

    chunk = len(labels) // PARTITIONS
    x = da.from_array(images, chunks=(chunk, *images.shape[1:]))
    y = da.from_array(labels, chunks=chunk)
    return tuple(client.persist([x, y]))


def tutorial_pipeline(x: Any, y: Any, global_batch: int) -> Any:
    """``from_dask((x, y)).map(scale).cache().shuffle(10_000, seed=0).batch(global_batch)``, as the tutorial."""
    return (dd.data.Dataset.from_dask((x, y)).map(scale).cache()
            .shuffle(SHUFFLE_BUFFER, seed=0).batch(global_batch))


def build_cnn(input_shape: tuple[int, ...] = IMAGE_SHAPE) -> Any:
    """The tutorial's CNN, compiled as in the tutorial (Adam, sparse CE from logits, accuracy)."""
    model = keras.Sequential([
        keras.layers.Conv2D(32, 3, activation="relu", input_shape=tuple(input_shape)),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def bare_block(batch: int, steps: int, warmup: int, seed: int, allreduce: bool = False) -> np.ndarray:
    """On a replica: ``steps`` training steps of a fresh copy of the CNN, without the framework.

    Each step makes, in order, the calls of ``BuiltinTrainable.train_step`` in
    ``daskdist/keras/trainable.py`` that do the model's math: forward through
    ``model.layers``, ``loss.per_example`` and its sum, ``loss.gradient``,
    backward through the layers in reverse, the trainable arrays, the gradient
    scaling by ``1 / count`` and ``optimizer.apply``, then the metric update.
    Left out: input pipeline, ``as_array``/``_ensure_built``, the step timer and
    the progress report, and (unless ``allreduce``) the all-reduce. With
    ``allreduce`` each step also makes ``fit``'s all-reduce call (one pack: the
    gradients, the example count, the loss sum) and scales by the global count,
    so the replicas synchronise every step as in ``fit``. Inputs: a few pre-made
    float32 batches, cycled. Returns an array ``(steps, 5)`` in seconds: step,
    math (all but apply and all-reduce), apply, CPU time of the whole worker
    process (all its threads) during the step, all-reduce.
    """
    from daskdist.ops import ReduceOp

    rng = np.random.default_rng(seed)
    batches = [(rng.random((batch, *IMAGE_SHAPE), dtype=np.float32),
                rng.integers(0, CLASSES, batch).astype(np.int64)) for _ in range(8)]
    model = build_cnn()
    model.build(IMAGE_SHAPE)
    layers = model.layers
    loss = model.loss
    optimizer = model.optimizer
    metrics = model.compiled_metrics
    ctx = dd.get_replica_context() if allreduce else None
    out = np.empty((steps, 5))
    for i in range(-warmup, steps):
        x, y = batches[i % len(batches)]
        c0 = time.process_time()
        t0 = time.perf_counter()
        y_pred = x
        for layer in layers:
            y_pred = layer.forward(y_pred, training=True)
        per_example = loss.per_example(y, y_pred)
        grad = loss.gradient(y, y_pred)
        for layer in reversed(layers):
            grad = layer.backward(grad)
        loss_sum = float(per_example.sum())
        params, grads = model._trainable_arrays()
        t1 = time.perf_counter()
        count = float(batch)
        if ctx is not None:
            stats = np.array([count, loss_sum], grads[0].dtype)  # as fit's step: one pack with the gradients
            total = ctx.all_reduce(ReduceOp.SUM, {"grads": grads, "stats": stats})
            grads, count = total["grads"], float(total["stats"][0])
        t2 = time.perf_counter()
        scale_ = 1.0 / count
        optimizer.apply(params, [g * g.dtype.type(scale_) for g in grads])
        t3 = time.perf_counter()
        for metric in metrics:
            metric.update_state(y, y_pred, None)
        t4 = time.perf_counter()
        c4 = time.process_time()
        if i >= 0:
            out[i] = (t4 - t0, (t1 - t0) + (t4 - t3), t3 - t2, c4 - c0, t2 - t1)
    return out


def environment(keys: tuple[str, ...]) -> dict:
    """``keys`` in this process's environment (``None``: unset); run on workers with ``client.run``."""
    import os

    return {k: os.environ.get(k) for k in keys}


def process_cpu_seconds() -> float:
    """CPU time (user + system, all threads) this process has used so far: run on workers with ``client.run``."""
    import os

    t = os.times()
    return t.user + t.system


class EpochTimer(keras.callbacks.Callback):
    """Times every epoch on the client (``time.perf_counter``), and notes its start as wall time.

    ``turns``/``name``: wait for this model's turn before each epoch and pass
    the turn on after it (``Turns``). ``before_epoch(epoch)`` runs just before
    the epoch is timed, ``after_epoch(epoch, wall_start)`` after, still within the turn.
    """

    def __init__(self, name: str = "", turns: Turns | None = None,
                 after_epoch: Callable[[int, float], None] | None = None,
                 before_epoch: Callable[[int], None] | None = None):
        super().__init__()
        self.name = name
        self.turns = turns
        self.after_epoch = after_epoch
        self.before_epoch = before_epoch
        self.seconds: list[float] = []
        self.load: list[float] = []
        self._start = 0.0
        self._wall = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.turns is not None:
            self.turns.wait(self.name)
        if self.before_epoch is not None:
            self.before_epoch(epoch)
        self._wall = time.time()
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.load.append(_load1())
        try:
            if self.after_epoch is not None:
                self.after_epoch(epoch, self._wall)
        finally:
            if self.turns is not None:
                self.turns.advance()


def _load1() -> float:
    import os

    return os.getloadavg()[0]


class Turns:
    """A fixed schedule of names: ``wait(name)`` blocks until it is ``name``'s turn; ``advance`` moves on."""

    def __init__(self, schedule: list[str]):
        self.schedule = list(schedule)
        self.position = 0
        self.failed: BaseException | None = None
        self._cv = threading.Condition()

    def wait(self, name: str) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.failed is not None or self.position >= len(self.schedule)
                              or self.schedule[self.position] == name)
            if self.failed is not None:
                raise RuntimeError(f"the other fit failed: {self.failed!r}")
            if self.position >= len(self.schedule):
                raise RuntimeError(f"{name} asked for an epoch beyond the schedule")

    def advance(self) -> None:
        with self._cv:
            self.position += 1
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self.failed = error
            self._cv.notify_all()

    def count(self, name: str) -> int:
        return self.schedule.count(name)


def abba(first: str, second: str, warmup: int, measured: int) -> list[str]:
    """``warmup`` epochs of ``first``, then of ``second``, then ``measured`` epochs of each in ABBA order."""
    order = [first] * warmup + [second] * warmup
    for i in range(measured):
        order += [first, second] if i % 2 == 0 else [second, first]
    return order
