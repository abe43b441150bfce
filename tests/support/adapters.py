"""The adapter axis of the test matrix: one fit behaviour, every model kind daskdist trains.

An ``Adapter`` builds the same small classifier (8 features, ``Dense(16, relu)``, ``Dense(4)`` logits,
``SGD``, sparse categorical cross-entropy on logits, accuracy) with one model kind's Keras: ``builtin`` is
daskdist's own numpy Keras (``daskdist.keras``), ``keras3-torch`` real Keras 3 on its torch backend
(``tests/keras3_models.py``), ``keras3-jax`` Keras 3 on JAX. Keras fixes its backend per process: the suite's
process runs Keras on torch, so its matrix holds ``keras3-torch``, and ``tests/test_keras3_jax.py`` runs the
matrix modules' ``keras3-jax`` cases in a process of their own with ``KERAS_BACKEND=jax`` (their
replicas threads of that process, ``matrix_client``: JAX's runtime threads do not survive the suite's fork
server). The matrix modules (``tests/test_matrix_*.py``) parametrise their bodies over ``ADAPTERS`` beside a
strategy combination (``tests/support/strategies.py``).

What every adapter is compared with is ``reference_fit``: the same network trained by numpy in float64 on the
same global batches, the same arithmetic written out once more (forward, softmax cross-entropy, backward,
SGD), so neither Keras is the other's reference and no strategy (the default one included) is its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

FEATURES, HIDDEN, CLASSES = 8, 16, 4


def data(rows: int = 80, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` float32 rows of 8 features and labels in 0..3 that a small network can learn."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    return x, ((x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)) % CLASSES


# -- the one-process reference -------------------------------------------------------------------------------


def _forward(weights: Sequence[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    kernel, bias, out_kernel, out_bias = weights
    hidden = np.maximum(x @ kernel + bias, 0.0)
    return hidden, hidden @ out_kernel + out_bias


def _loss_and_softmax(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_softmax[np.arange(len(y)), y], np.exp(log_softmax)


def reference_predict(weights: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The logits of ``x`` under ``weights`` (float64)."""
    return _forward([np.asarray(w, np.float64) for w in weights], np.asarray(x, np.float64))[1]


def reference_evaluate(weights: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean loss, accuracy) of every row."""
    logits = reference_predict(weights, x)
    losses, _ = _loss_and_softmax(logits, y)
    return float(losses.mean()), float((logits.argmax(axis=1) == y).mean())


@dataclass
class ReferenceRun:
    """What ``reference_fit`` trained: the weights after each epoch and the epoch logs as Keras reports them."""

    weights: list[np.ndarray]
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    epoch_weights: list[list[np.ndarray]] = field(default_factory=list)
    batch_logs: list[list[tuple[float, float]]] = field(default_factory=list)
    batch_losses: list[float] = field(default_factory=list)


def reference_fit(weights: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, batch_size: int, epochs: int,
                  learning_rate: float | Callable[[int], float] = 0.1,
                  divide_by: int | None = None) -> ReferenceRun:
    """SGD over the global batches ``x[i:i + batch_size]`` in order, ``epochs`` times, in float64.

    ``learning_rate`` is a rate or a schedule of the epoch (``LearningRateScheduler``'s). The epoch loss and
    accuracy are the running means over the epoch's rows, which is what Keras' logs hold (each batch's mean
    weighted by its rows); ``batch_logs`` holds those running means after each step. ``divide_by``: each step's
    loss is its per-example losses summed over that many rows (TF's custom-training ``compute_average_loss`` with
    a fixed global batch size, which a short last batch divides too) instead of their mean; ``batch_losses``.
    """
    w = [np.asarray(a, np.float64).copy() for a in weights]
    run = ReferenceRun(weights=w)
    for epoch in range(epochs):
        rate = learning_rate(epoch) if callable(learning_rate) else learning_rate
        loss_sum = correct = rows = 0.0
        logs = []
        for start in range(0, len(x), batch_size):
            xb, yb = np.asarray(x[start:start + batch_size], np.float64), y[start:start + batch_size]
            hidden, logits = _forward(w, xb)
            losses, softmax = _loss_and_softmax(logits, yb)
            loss_sum, correct, rows = (loss_sum + losses.sum(), correct + (logits.argmax(axis=1) == yb).sum(),
                                       rows + len(yb))
            logs.append((loss_sum / rows, correct / rows))
            denominator = divide_by or len(yb)
            run.batch_losses.append(float(losses.sum() / denominator))
            d_logits = softmax
            d_logits[np.arange(len(yb)), yb] -= 1.0
            d_logits /= denominator
            d_hidden = (d_logits @ w[2].T) * (hidden > 0)
            grads = [xb.T @ d_hidden, d_hidden.sum(axis=0), hidden.T @ d_logits, d_logits.sum(axis=0)]
            w = [a - rate * g for a, g in zip(w, grads)]
        run.loss.append(loss_sum / rows)
        run.accuracy.append(correct / rows)
        run.epoch_weights.append(w)
        run.batch_logs.append(logs)
    run.weights = w
    return run


def assert_weights(got: Sequence[np.ndarray], want: Sequence[np.ndarray], rtol: float = 1e-5,
                   atol: float = 1e-6) -> None:
    """Every weight of ``got`` (float32) within float32 rounding of ``want``, and as many of them."""
    got, want = list(got), list(want)
    assert len(got) == len(want), (len(got), len(want))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=atol)


# -- the adapters --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    """One model kind: its Keras module and what differs between them (checkpoint files, replica copies)."""

    name: str
    #: the module with ``Sequential``, ``layers``, ``optimizers``, ``losses`` and ``callbacks``
    load_keras: Callable[[], object] = field(repr=False)
    #: ``ModelCheckpoint``'s file pattern for weights (``{epoch}`` in it) and the files its epochs leave
    checkpoint_pattern: str
    checkpoint_files: Callable[[Sequence[int]], set[str]] = field(repr=False)
    replica_weights: Callable[[object, object], list[list[np.ndarray]]] = field(repr=False)
    #: ``(model, optimizer, global_batch) -> step``: TF's custom-training step for ``strategy.run``, its loss
    #: each replica's summed per-example losses over the global batch size
    custom_step: Callable[[object, object, int], Callable] = field(repr=False)
    #: the optimizer's step count the client's model shows
    iterations: Callable[[object], int] = field(repr=False)
    #: run on fresh workers before an elastic group starts on them (an import that holds a loaded worker's GIL
    #: for seconds would miss the group's heartbeats)
    prepare_workers: Callable[[object], None] = field(repr=False)

    def __str__(self) -> str:
        return self.name

    @property
    def keras(self):
        return self.load_keras()

    def model(self, weights: Sequence[np.ndarray] | None = None, learning_rate: float = 0.1):
        """The classifier, compiled with ``SGD(learning_rate)``, built, with ``weights`` if given.

        Made in a strategy's scope where one is entered (the caller's ``with strategy.scope()``).
        """
        keras = self.keras
        first = ([keras.layers.Dense(HIDDEN, activation="relu", input_shape=(FEATURES,))] if self.name == "builtin"
                 else [keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu")])
        made = keras.Sequential([*first, keras.layers.Dense(CLASSES)])
        made.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     optimizer=keras.optimizers.SGD(learning_rate), metrics=["accuracy"])
        made.build((None, FEATURES) if self.name != "builtin" else (FEATURES,))
        if weights is not None:
            made.set_weights([np.asarray(w, np.float32) for w in weights])
        return made

    def assert_replicas_identical(self, strategy, model) -> None:
        """Every replica's copy of ``model``'s weights equals replica 0's, bit for bit."""
        copies = self.replica_weights(strategy, model)
        assert copies, "no replica holds the model"
        for rank, copy in enumerate(copies[1:], start=1):
            assert len(copy) == len(copies[0])
            for a, b in zip(copy, copies[0]):
                assert np.array_equal(a, b), f"replica {rank} holds other weights than replica 0"


def _builtin_keras():
    from daskdist import keras

    return keras


def _keras3_on(backend: str):
    os.environ.setdefault("KERAS_BACKEND", backend)
    import keras

    if keras.backend.backend() != backend:
        import pytest

        pytest.skip(f"this process runs Keras 3 on {keras.backend.backend()}"
                    + (": tests/test_keras3_jax.py runs the keras3-jax cases" if backend == "jax" else ""))
    return keras


def _keras3_torch():
    return _keras3_on("torch")


def _keras3_jax():
    return _keras3_on("jax")


def _builtin_replica_weights(strategy, model) -> list[list[np.ndarray]]:
    from daskdist.training.commands import model_weights

    if not getattr(model, "_installed", False):  # the default strategy: the model trains here
        return [model.get_weights()]
    return strategy.extended.run_on_replicas(model_weights, (model.model_id,))


def _keras3_replica_weights(strategy, model) -> list[list[np.ndarray]]:
    from daskdist.plugins.keras3 import registry
    from daskdist.training.commands import model_weights

    record = registry.lookup(model)
    if record is None:  # the default strategy: plain Keras in this process
        return [model.get_weights()]
    return strategy.extended.run_on_replicas(model_weights, (record.object_id,))


def _builtin_checkpoint_files(epochs: Sequence[int]) -> set[str]:
    """A verified tensor file and its metadata per epoch, and the ``checkpoint`` index of the newest."""
    return {"checkpoint"} | {f"ckpt_{e}{ext}" for e in epochs for ext in (".safetensors", ".json")}


def _builtin_custom_step(model, optimizer, global_batch: int) -> Callable:
    """daskdist's ``GradientTape`` and ``compute_average_loss``, then ``apply_gradients`` (gradients summed)."""
    import daskdist as dd
    from daskdist import keras

    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(batch):
        x, y = batch
        with dd.GradientTape() as tape:
            loss = dd.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=global_batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return float(loss)

    return step


def _keras3_custom_step(model, optimizer, global_batch: int) -> Callable:
    """Keras' forward, torch's backward, ``optimizer.apply`` (``tests/keras3_models.py``)."""
    from tests.keras3_models import average_loss, torch_train_step

    return torch_train_step(model, optimizer, average_loss(global_batch))


def _keras3_jax_custom_step(model, optimizer, global_batch: int) -> Callable:
    """TF's custom-training step on JAX: ``jax.value_and_grad`` of ``stateless_call``, then ``optimizer.apply``."""
    import jax
    import keras

    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def step(batch):
        x, y = batch
        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss_fn(trainable):
            logits, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return keras.ops.sum(loss_object(y, logits)) / global_batch

        loss, gradients = jax.value_and_grad(loss_fn)([v.value for v in model.trainable_variables])
        optimizer.apply(gradients, model.trainable_variables)  # in a replica: summed over the replicas
        return float(loss)

    return step


def _prepare_torch_replica() -> None:
    from daskdist.plugins.keras3.backend import prepare_replica

    prepare_replica("torch")  # its ``keras`` module stays on the worker (sent back, it would import Keras here)


def _keras3_prepare_workers(client) -> None:
    client.run(_prepare_torch_replica)


BUILTIN = Adapter("builtin", _builtin_keras, "ckpt_{epoch}", _builtin_checkpoint_files, _builtin_replica_weights,
                  _builtin_custom_step, lambda model: int(model._optimizer_state()["iterations"]),
                  lambda client: None)
KERAS3_TORCH = Adapter("keras3-torch", _keras3_torch, "ckpt_{epoch}.weights.h5",
                       lambda epochs: {f"ckpt_{e}.weights.h5" for e in epochs}, _keras3_replica_weights,
                       _keras3_custom_step, lambda model: int(model.optimizer.iterations.numpy()),
                       _keras3_prepare_workers)
KERAS3_JAX = Adapter("keras3-jax", _keras3_jax, "ckpt_{epoch}.weights.h5",
                     lambda epochs: {f"ckpt_{e}.weights.h5" for e in epochs}, _keras3_replica_weights,
                     _keras3_jax_custom_step, lambda model: int(model.optimizer.iterations.numpy()),
                     lambda client: None)

#: the adapters of this process: Keras 3 on the backend its Keras runs (``KERAS_BACKEND``; the suite's: torch),
#: so the suite holds no keras3-jax case that could only skip: ``tests/test_keras3_jax.py`` runs them
ADAPTERS = [BUILTIN, KERAS3_JAX if os.environ.get("KERAS_BACKEND") == "jax" else KERAS3_TORCH]
#: the adapters of the suite's own process, whose replicas may be its fork server's processes (elastic kills)
FORKED_ADAPTERS = [BUILTIN, KERAS3_TORCH]
