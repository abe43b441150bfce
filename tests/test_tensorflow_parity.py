"""Where the built-in API answers as TensorFlow's does: loss and metric names, dtypes, mixed strategies, errors.

Custom-loop gradients are tests/test_gradient_tape.py; the multi-worker example is
tests/test_examples_multi_worker.py.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest

import daskdist as dd
from daskdist import keras
from daskdist.keras import losses, metrics

# tf.keras.losses.get's names for the built-in losses (tf_keras/losses.py: the functions and their aliases)
TF_KERAS_LOSS_NAMES = [
    "binary_crossentropy", "bce", "categorical_crossentropy", "sparse_categorical_crossentropy",
    "categorical_hinge", "hinge", "squared_hinge", "cosine_similarity", "huber", "huber_loss", "kl_divergence",
    "kld", "KLD", "kullback_leibler_divergence", "log_cosh", "logcosh", "mean_absolute_error", "mae", "MAE",
    "mean_absolute_percentage_error", "mape", "MAPE", "mean_squared_error", "mse", "MSE",
    "mean_squared_logarithmic_error", "msle", "MSLE", "poisson",
    "BinaryCrossentropy", "CategoricalCrossentropy", "SparseCategoricalCrossentropy", "CategoricalHinge", "Hinge",
    "SquaredHinge", "CosineSimilarity", "Huber", "KLDivergence", "LogCosh", "MeanAbsoluteError",
    "MeanAbsolutePercentageError", "MeanSquaredError", "MeanSquaredLogarithmicError", "Poisson",
]
# compile(metrics=[...]) strings of tf.keras for the built-in mean metrics: compile's own ("accuracy", "acc",
# "crossentropy", "ce"), tf_keras/metrics' functions and aliases, and the metric class names
TF_KERAS_METRIC_NAMES = [
    "accuracy", "acc", "crossentropy", "ce", "binary_accuracy", "categorical_accuracy",
    "sparse_categorical_accuracy", "top_k_categorical_accuracy", "sparse_top_k_categorical_accuracy",
    "mae", "mse", "mape", "msle", "MAE", "MSE", "MAPE", "MSLE", "mean_absolute_error", "mean_squared_error",
    "mean_absolute_percentage_error", "mean_squared_logarithmic_error", "kld", "KLD", "kl_divergence",
    "kullback_leibler_divergence", "logcosh", "log_cosh", "hinge", "squared_hinge", "categorical_hinge", "poisson",
    "cosine_similarity", "binary_crossentropy", "categorical_crossentropy", "sparse_categorical_crossentropy",
    "Accuracy", "BinaryAccuracy", "CategoricalAccuracy", "SparseCategoricalAccuracy", "TopKCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy", "MeanAbsoluteError", "MeanSquaredError", "MeanAbsolutePercentageError",
    "MeanSquaredLogarithmicError", "RootMeanSquaredError", "KLDivergence", "LogCoshError", "Hinge", "SquaredHinge",
    "CategoricalHinge", "Poisson", "CosineSimilarity", "BinaryCrossentropy", "CategoricalCrossentropy",
    "SparseCategoricalCrossentropy", "Precision", "Recall",
]


# -- losses and metrics by name ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TF_KERAS_LOSS_NAMES)
def test_every_keras_loss_name_is_known(name):
    assert isinstance(losses.get(name), losses.Loss)


def _loss_inputs(loss):
    rng = np.random.default_rng(3)
    if isinstance(loss, losses.SparseCategoricalCrossentropy):
        return rng.integers(0, 4, 6), rng.dirichlet(np.ones(4), 6) * 1.2
    if isinstance(loss, (losses.CategoricalCrossentropy, losses.KLDivergence, losses.CategoricalHinge)):
        return np.eye(4)[rng.integers(0, 4, 6)] * 0.9 + 0.025, rng.dirichlet(np.ones(4), 6)
    if isinstance(loss, (losses.BinaryCrossentropy,)):
        return rng.integers(0, 2, (6, 4)).astype(float), rng.uniform(0.05, 0.95, (6, 4))
    if isinstance(loss, (losses.Hinge, losses.SquaredHinge)):
        return rng.choice([-1.0, 1.0], (6, 4)), rng.standard_normal((6, 4))
    if isinstance(loss, (losses.Poisson, losses.MeanSquaredLogarithmicError)):
        return rng.uniform(0.1, 3, (6, 4)), rng.uniform(0.1, 3, (6, 4))
    return rng.standard_normal((6, 4)), rng.standard_normal((6, 4)) * 2


LOSS_CLASSES = ["BinaryCrossentropy", "CategoricalCrossentropy", "CategoricalHinge", "CosineSimilarity", "Hinge",
                "Huber", "KLDivergence", "LogCosh", "MeanAbsoluteError", "MeanAbsolutePercentageError",
                "MeanSquaredError", "MeanSquaredLogarithmicError", "Poisson", "SparseCategoricalCrossentropy",
                "SquaredHinge"]


#: tf_keras' lower-case loss names and aliases, each with the class it names (a class name names itself)
LOSS_ALIASES = {
    "binary_crossentropy": "BinaryCrossentropy", "bce": "BinaryCrossentropy",
    "categorical_crossentropy": "CategoricalCrossentropy",
    "sparse_categorical_crossentropy": "SparseCategoricalCrossentropy", "categorical_hinge": "CategoricalHinge",
    "hinge": "Hinge", "squared_hinge": "SquaredHinge", "cosine_similarity": "CosineSimilarity", "huber": "Huber",
    "huber_loss": "Huber", "kl_divergence": "KLDivergence", "kld": "KLDivergence", "KLD": "KLDivergence",
    "kullback_leibler_divergence": "KLDivergence", "log_cosh": "LogCosh", "logcosh": "LogCosh",
    "mean_absolute_error": "MeanAbsoluteError", "mae": "MeanAbsoluteError", "MAE": "MeanAbsoluteError",
    "mean_absolute_percentage_error": "MeanAbsolutePercentageError", "mape": "MeanAbsolutePercentageError",
    "MAPE": "MeanAbsolutePercentageError", "mean_squared_error": "MeanSquaredError", "mse": "MeanSquaredError",
    "MSE": "MeanSquaredError", "mean_squared_logarithmic_error": "MeanSquaredLogarithmicError",
    "msle": "MeanSquaredLogarithmicError", "MSLE": "MeanSquaredLogarithmicError", "poisson": "Poisson",
}


def test_the_loss_classes_cover_every_keras_name():
    assert sorted({type(losses.get(n)).__name__ for n in TF_KERAS_LOSS_NAMES}) == LOSS_CLASSES


@pytest.mark.parametrize("name", TF_KERAS_LOSS_NAMES)
def test_each_loss_name_gives_the_class_it_names(name):
    """Name by name (a swapped alias, say "MSE" giving MeanAbsoluteError, keeps the set of classes the same)."""
    assert type(losses.get(name)).__name__ == LOSS_ALIASES.get(name, name)


@pytest.mark.parametrize("name", LOSS_CLASSES)
def test_every_loss_gradient_matches_finite_differences(name):
    loss = losses.get(name)
    y_true, y_pred = _loss_inputs(loss)
    per = loss.per_example(y_true, y_pred)
    assert per.shape == (6,) and np.isfinite(per).all()
    grad = loss.gradient(y_true, y_pred)
    r = np.random.default_rng(7).standard_normal(6)
    numeric = np.zeros_like(y_pred)
    eps = 1e-6
    for i in np.ndindex(y_pred.shape):
        old = y_pred[i]
        y_pred[i] = old + eps
        up = (loss.per_example(y_true, y_pred) * r).sum()
        y_pred[i] = old - eps
        down = (loss.per_example(y_true, y_pred) * r).sum()
        y_pred[i] = old
        numeric[i] = (up - down) / (2 * eps)
    np.testing.assert_allclose(grad * r[:, None], numeric, rtol=1e-4, atol=1e-6)
    assert loss(y_true, y_pred) == pytest.approx(per.mean())


def test_keras_values_of_the_new_losses():
    """Values of Keras' own docstring examples (tf.keras.losses.*)."""
    y_true, y_pred = np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[1.0, 1.0], [1.0, 0.0]])
    assert losses.get("mae")(y_true, y_pred) == pytest.approx(0.5)
    assert losses.get("mape")(np.array([[2.0, 1.0], [2.0, 3.0]]), y_pred) == pytest.approx(50.0)
    assert losses.get("msle")(y_true, y_pred) == pytest.approx(0.240, abs=1e-3)
    assert losses.get("logcosh")(y_true, np.array([[1.0, 1.0], [0.0, 0.0]])) == pytest.approx(0.108, abs=1e-3)
    assert losses.get("huber")(np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[0.6, 0.4], [0.4, 0.6]])) == \
        pytest.approx(0.155)
    assert losses.get("bce")(np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[0.6, 0.4], [0.4, 0.6]])) == \
        pytest.approx(0.815, abs=1e-3)
    assert losses.get("hinge")(np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[0.6, 0.4], [0.4, 0.6]])) == \
        pytest.approx(1.3)
    assert losses.get("squared_hinge")(np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[0.6, 0.4], [0.4, 0.6]])) \
        == pytest.approx(1.86)
    assert losses.get("categorical_hinge")(np.array([[0, 1], [0, 0]]), np.array([[0.6, 0.4], [0.4, 0.6]])) == \
        pytest.approx(1.4)
    assert losses.get("kld")(np.array([[0, 1], [0, 0]]), np.array([[0.6, 0.4], [0.4, 0.6]])) == \
        pytest.approx(0.458, abs=1e-3)
    assert losses.get("poisson")(np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[1.0, 1.0], [0.0, 0.0]])) == \
        pytest.approx(0.5)
    assert losses.get("cosine_similarity")(np.array([[0.0, 1.0], [1.0, 1.0]]), np.array([[1.0, 0.0], [1.0, 1.0]])) \
        == pytest.approx(-0.5)


def test_unknown_names_are_refused_on_the_client_listing_the_known_ones():
    with pytest.raises(ValueError, match="known: .*mae.*mse"):
        losses.get("hinge-ish")
    with pytest.raises(ValueError, match="known: .*mae.*mse") as info:
        metrics.get("f1ish")
    assert "'mean'" not in str(info.value) and " mean," not in str(info.value)  # no longer offered: it fails in fit
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(2,))])
    with pytest.raises(ValueError, match="Unknown metric 'mean'"):
        model.compile(optimizer="sgd", loss="mse", metrics=["mean"])
    with pytest.raises(TypeError, match="cannot be compiled.*update_state takes \\(values, sample_weight\\)"):
        model.compile(optimizer="sgd", loss="mse", metrics=[keras.metrics.Mean()])
    with pytest.raises(TypeError, match="is a function"):
        model.compile(optimizer="sgd", loss=lambda t, p: (t - p) ** 2)


@pytest.mark.parametrize("name", TF_KERAS_METRIC_NAMES)
def test_every_keras_metric_name_compiles(name):
    model = keras.Sequential([keras.layers.Dense(3, input_shape=(2,))])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=[name])
    metric = model.compiled_metrics[0]
    if name.lower() == name:  # a Keras name keeps the name it was asked by, as in Keras' logs
        assert metric.name == name


def _metric_reference(name, y, onehot, pred):
    """numpy's value of the metric on the whole data."""
    probs = pred / pred.sum(-1, keepdims=True)  # the model ends with a softmax
    return {
        "mae": np.abs(pred - onehot).mean(),
        "mse": ((pred - onehot) ** 2).mean(),
        "acc": (pred.argmax(-1) == onehot.argmax(-1)).mean(),
        "top_k_categorical_accuracy": 1.0,  # k=5 > 3 classes
        "logcosh": np.log(np.cosh(pred - onehot)).mean(),
        "ce": (-np.log(np.clip(probs, 1e-7, 1 - 1e-7)) * onehot).sum(-1).mean(),
        "RootMeanSquaredError": np.sqrt(((pred - onehot) ** 2).mean()),
        "cosine_similarity": ((onehot / np.linalg.norm(onehot, axis=-1, keepdims=True))
                              * (pred / np.linalg.norm(pred, axis=-1, keepdims=True))).sum(-1).mean(),
        "my_metric": (pred - onehot).max(-1).mean(),
    }[name]


def test_metrics_by_name_train_and_aggregate_over_replicas(threaded_client):
    """fit and evaluate with Keras' metric names on 3 replicas: every value as numpy computes it on all rows."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((90, 4)).astype(np.float32)
    y = rng.integers(0, 3, 90)
    onehot = np.eye(3, dtype=np.float32)[y]

    def my_metric(y_true, y_pred):  # a function is wrapped in MeanMetricWrapper, as in Keras
        return (y_pred - y_true).max(axis=-1)

    names = ["mae", "mse", "acc", "top_k_categorical_accuracy", "logcosh", "ce", "cosine_similarity",
             "RootMeanSquaredError"]
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(3, activation="softmax", input_shape=(4,))])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="categorical_crossentropy",
                          metrics=[*names, my_metric])
        history = model.fit(x, onehot, batch_size=30, epochs=2, verbose=0)
        # a Keras name is the log's key; a class name gives the class's default name, as in Keras
        keys = [n if n != "RootMeanSquaredError" else "root_mean_squared_error" for n in [*names, "my_metric"]]
        assert {*keys, "loss"} <= set(history.history)
        logs = model.evaluate(x, onehot, batch_size=30, verbose=0, return_dict=True)
        pred = model.predict(x, batch_size=30)
    for name, key in zip([*names, "my_metric"], keys):
        assert logs[key] == pytest.approx(_metric_reference(name, y, onehot, pred), rel=1e-4, abs=1e-5), name


@pytest.mark.parametrize("name", ["mae", "msle", "poisson", "hinge", "kld", "bce", "huber"])
def test_fit_with_every_new_loss_lowers_it(name):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    target = (1 / (1 + np.exp(-(x @ np.array([[1.0], [-2.0], [0.5]], np.float32))))).astype(np.float32)
    if name == "hinge":
        target = np.where(target > 0.5, 1.0, -1.0).astype(np.float32)
    if name == "kld":
        target = np.concatenate([target, 1 - target], axis=1)
    activation = "softmax" if name == "kld" else ("sigmoid" if name in ("bce", "poisson", "msle") else None)
    model = keras.Sequential([keras.layers.Dense(target.shape[1], activation=activation, input_shape=(3,))])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=name)
    history = model.fit(x, target, batch_size=16, epochs=15, verbose=0)
    best = losses.get(name)(target, target)  # each loss is smallest where the prediction is the target
    first, last = history.history["loss"][0], history.history["loss"][-1]
    assert last - best < 0.7 * (first - best), (first, last, best)


def test_precision_and_recall_sum_over_replicas(threaded_client):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((60, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5], np.float32) > 0).astype(np.float32).reshape(-1, 1)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(1, activation="sigmoid", input_shape=(3,))])
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy",
                          metrics=["Precision", keras.metrics.Recall(thresholds=0.3)])
        model.fit(x, y, batch_size=20, epochs=3, verbose=0)
        logs = model.evaluate(x, y, batch_size=20, verbose=0, return_dict=True)
        pred = model.predict(x)
    tp = ((pred > 0.5) & (y > 0.5)).sum()
    assert logs["precision"] == pytest.approx(tp / (pred > 0.5).sum())
    assert logs["recall"] == pytest.approx(((pred > 0.3) & (y > 0.5)).sum() / (y > 0.5).sum())


# -- dtypes -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, dtype", [
    (1.0, np.float32), ([1.0, 2.0], np.float32), (1, np.int32), ([1, 2], np.int32), (True, np.bool_),
    ([[1, 2.5]], np.float32), (2 ** 40, np.int64),
    (np.float64(1.0), np.float64), (np.arange(3), np.arange(3).dtype), (np.ones(2, np.float16), np.float16),
])
def test_variables_infer_dtypes_as_tensorflow(value, dtype):
    assert dd.Variable(value).dtype == np.dtype(dtype)
    assert dd.Variable(value, dtype="float64").dtype == np.float64  # an explicit dtype wins


def test_variables_in_a_scope_infer_dtypes_as_tensorflow(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            f, i = dd.Variable(1.0), dd.Variable([1, 2])
        assert f.dtype == np.float32 and i.dtype == np.int32
        values = strategy.experimental_local_results(strategy.run(lambda: f.read_value()))
        assert all(np.asarray(v).dtype == np.float32 for v in values)


@pytest.mark.parametrize("tensors, specs", [
    ([1.0, 2.0, 3.0], ((), np.float32)),
    ([1, 2, 3], ((), np.int32)),
    ([True, False], ((), np.bool_)),
    ([[1.0, 2.0], [3.0, 4.0]], ((2,), np.float32)),
    (np.arange(3.0), ((), np.float64)),
])
def test_from_tensor_slices_of_python_lists_infers_as_tensorflow(tensors, specs):
    dataset = dd.data.Dataset.from_tensor_slices(tensors)
    spec = dataset.element_spec
    assert (spec.shape, np.dtype(spec.dtype)) == (specs[0], np.dtype(specs[1]))
    rows = list(dataset)
    assert len(rows) == len(tensors) and np.asarray(rows[0]).dtype == np.dtype(specs[1])


def test_from_tensor_slices_of_a_tuple_of_lists_is_a_structure():
    dataset = dd.data.Dataset.from_tensor_slices(([1.0, 2.0], [3, 4]))
    x_spec, y_spec = dataset.element_spec
    assert np.dtype(x_spec.dtype) == np.float32 and np.dtype(y_spec.dtype) == np.int32
    assert [(float(a), int(b)) for a, b in dataset] == [(1.0, 3), (2.0, 4)]


# -- strategies mixed -----------------------------------------------------------------------------------------


def test_mixing_two_strategies_raises_as_tensorflow_does(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as a, dd.MirroredStrategy(client=threaded_client) as b:
        with a.scope():
            with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
                with b.scope():
                    pass
            with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects") as info:
                b.run(lambda: 1)
            assert a.extended.token in str(info.value) and b.extended.token in str(info.value)
            with a.scope():  # the same strategy again is fine
                assert a.run(lambda: 1) == 1
            v = dd.Variable(1.0, name="weights_of_a")
        with pytest.raises(ValueError, match="weights_of_a") as info:
            b.run(lambda: v.read_value())
        message = str(info.value)
        assert a.extended.token in message and b.extended.token in message and "closed" not in message
        assert float(np.asarray(a.experimental_local_results(a.run(lambda: v.read_value()))[0])) == 1.0


def test_results_whose_structures_differ_between_replicas_are_refused(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        def uneven():
            rank = dd.get_replica_context().replica_id_in_sync_group
            return [np.ones(1)] * (rank + 1)

        with pytest.raises(ValueError, match="different structures: replica 0 .* replica 1"):
            strategy.run(uneven)

        def keys():
            rank = dd.get_replica_context().replica_id_in_sync_group
            return {"a": 1.0} if rank == 0 else {"b": 1.0}

        with pytest.raises(ValueError, match="different structures"):
            strategy.run(keys)
        same = strategy.run(lambda: {"a": np.ones(2)})  # and the same structure still regroups
        assert isinstance(same["a"], dd.PerReplica)


# -- errors from replicas ---------------------------------------------------------------------------------------


def test_a_replica_error_carries_no_unrelated_queue_empty(process_client):
    def boom():
        raise ValueError("boom from the replica")

    with dd.MirroredStrategy(client=process_client) as strategy:
        with pytest.raises(ValueError, match="boom from the replica") as info:
            strategy.run(boom)
    text = "".join(traceback.format_exception(info.value))
    assert "Empty" not in text and "During handling of the above exception" not in text, text
    assert info.value.__context__ is None or "Empty" not in type(info.value.__context__).__name__


def test_fit_with_numpy_x_of_the_wrong_width_fails_on_the_client(threaded_client):
    x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
            model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(ValueError, match=r"fit: the model takes one array x of shape \(None, 3\).*\(None, 4\)"):
            model.fit(x, y, batch_size=4, verbose=0)
        with pytest.raises(ValueError, match=r"evaluate: .*\(None, 3\).*\(None, 4\)"):
            model.evaluate(x, y, batch_size=4, verbose=0)
        model.fit(x[:, :3], y, batch_size=4, verbose=0)  # the right width trains
    local = keras.Sequential([keras.layers.Dense(1)])  # built by a first fit: later fits are checked too
    local.compile(optimizer="sgd", loss="mse")
    local.fit(x[:, :3], y, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match=r"\(None, 3\).*\(None, 4\)"):
        local.fit(x, y, batch_size=4, verbose=0)


def test_python_numbers_in_collectives_keep_numpy_dtypes(threaded_client):
    """The deliberate difference docs/strategies.md lists: no float32 narrowing of Python numbers there."""
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        out = strategy.run(lambda: dd.get_replica_context().all_reduce(dd.ReduceOp.SUM, 1.0))
        assert {np.asarray(v).dtype for v in strategy.experimental_local_results(out)} == {np.dtype(np.float64)}
