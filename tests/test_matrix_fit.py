"""``fit``, ``evaluate`` and ``predict`` on every synchronous strategy combination x every in-process adapter.

One body: the model trains on the same global batches as the numpy reference (``tests/support/adapters.py``,
float64 SGD in this process), whatever the combination splits them into (3 replicas: 16 rows split 6/5/5),
ends with identical replicas, reports the reference's epoch logs, evaluates and predicts as the reference,
and a saved model loads in a process without a strategy with the trained weights. The default strategy
runs the same body: it is compared with numpy, not with itself. The replicas are worker processes
(``matrix_client``, shared with the session's other modules).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import daskdist as dd
from daskdist.training.runner_choice import RunnerKind, choose_runner
from tests.support.adapters import ADAPTERS, assert_weights, data, reference_evaluate, reference_fit, reference_predict
from tests.support.strategies import COMBINATIONS, SYNCHRONOUS

pytestmark = pytest.mark.timeout(600)

BATCH, EPOCHS = 16, 2


@pytest.fixture(scope="module")
def reference():
    """The initial weights (seeded) and the numpy run from them: one per module, shared by the matrix."""
    rng = np.random.default_rng(11)
    initial = [rng.uniform(-0.5, 0.5, shape).astype(np.float32) for shape in ((8, 16), (16,), (16, 4), (4,))]
    x, y = data(rows=80)  # 5 global batches of 16
    return initial, reference_fit(initial, x, y, BATCH, EPOCHS)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=str)
@pytest.mark.parametrize("combination", SYNCHRONOUS, ids=str)
def test_fit_equals_one_process_on_the_same_global_batches(combination, adapter, matrix_client, reference,
                                                           tmp_path):
    initial, expected = reference
    x, y = data(rows=80)
    with combination.strategy(matrix_client) as strategy:
        with strategy.scope():
            model = adapter.model(initial)
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        assert_weights(model.get_weights(), expected.weights)
        adapter.assert_replicas_identical(strategy, model)
        np.testing.assert_allclose(history.history["loss"], expected.loss, rtol=1e-5)
        np.testing.assert_allclose(history.history["accuracy"], expected.accuracy, rtol=1e-6)
        loss, accuracy = model.evaluate(x, y, batch_size=32, verbose=0)
        assert (loss, accuracy) == pytest.approx(reference_evaluate(expected.weights, x, y), rel=1e-5)
        np.testing.assert_allclose(model.predict(x[:20], verbose=0), reference_predict(expected.weights, x[:20]),
                                   rtol=1e-5, atol=1e-5)
        path = str(tmp_path / ("model" if adapter.name == "builtin" else "model.keras"))
        model.save(path)
    loaded = adapter.keras.models.load_model(path)  # outside any strategy
    assert_weights(loaded.get_weights(), expected.weights)


def _elastic(client):
    return dd.MirroredStrategy(client=client, elastic=dd.ElasticOptions(min_replicas=2))


#: (name, make(client), the runner its Extended asks for): every combination, and an elastic one
RUNNERS = [(c.name, c.make, {"default": RunnerKind.LOCAL, "parameter_server": RunnerKind.CLOSURES}.get(
    c.name, RunnerKind.REPLICAS)) for c in COMBINATIONS] + [("elastic", _elastic, RunnerKind.ELASTIC)]


def _train_hooks(loop: str) -> list[str]:
    return ["BatchHook"] if loop == "train" else []


@pytest.mark.parametrize(("name", "make", "want"), RUNNERS, ids=[r[0] for r in RUNNERS])
def test_the_trainer_chooses_each_combinations_runner_from_its_extended(name, make, want, matrix_client):
    """``choose_runner``, which both adapters' ``fit``, ``evaluate`` and ``predict`` ask: the kind each Extended's
    capabilities give, stepwise with a per-batch hook where the replicas can run one, refused where not."""
    with contextlib.ExitStack() as stack:
        strategy = make(matrix_client)
        if name != "default":  # the default strategy is never closed
            stack.enter_context(strategy)
        plain = choose_runner(strategy)
        assert plain.kind is want and not plain.per_batch_test
        assert plain.elastic is (strategy.extended.elastic if want is RunnerKind.ELASTIC else None)
        assert choose_runner(strategy, _train_hooks, training=False).kind is want  # an evaluation: never refused
        if want is RunnerKind.CLOSURES:
            with pytest.raises(ValueError, match=r"Found: \['BatchHook'\]"):
                choose_runner(strategy, _train_hooks)
        elif want is RunnerKind.ELASTIC:
            with pytest.raises(NotImplementedError, match=r"Found: \['BatchHook'\]"):
                choose_runner(strategy, _train_hooks)
        elif want is RunnerKind.REPLICAS:
            assert choose_runner(strategy, _train_hooks).kind is RunnerKind.STEPWISE
            assert choose_runner(strategy, lambda loop: ["TestHook"] if loop == "test" else []).per_batch_test
        else:
            assert choose_runner(strategy, _train_hooks).kind is RunnerKind.LOCAL
