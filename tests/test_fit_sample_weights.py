"""``validation_split``, ``class_weight`` and ``sample_weight`` in ``fit``, both adapters, as one process runs them.

Each case trains a model under MirroredStrategy (two replicas) and
MultiWorkerMirroredStrategy (three, one per worker process) and the same
model in one process on the same global batches: Keras 3 (torch backend)
against plain Keras 3, the built-in layers against their own one-process
``fit``. The weights are uneven across each global batch's replica shares
(the rows of one share weigh 25 times those of another, the last global
batch splits unevenly), so a replica that averaged its own weighted mean,
or a global loss divided by the weights' sum instead of the rows, would
train other weights. Refused arguments raise Keras' errors on the client
before anything runs; the strategy then trains on. Keras 3 on JAX: in
``tests/test_keras3_jax.py``'s subprocess (Keras' backend is per process).
"""

from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, here and in the workers
pytest.importorskip("torch")
pytest.importorskip("keras")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskdist as dd  # noqa: E402
from daskdist import keras as builtin  # noqa: E402
from daskdist.cluster.identity import scheduler_workers  # noqa: E402
from tests.keras3_models import assert_replicas_identical, dense_data, sequential  # noqa: E402
from tests.support.closeness import max_rel  # noqa: E402

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-5  # float32 weights after a few steps, the summation order of the replicas' shares apart
ROWS, BATCH = 80, 32  # global batches of 32, 32, 16: two replicas take 16/16 then 8/8, three 11/11/10 then 6/5/5
CLASS_WEIGHT = {0: 0.5, 1: 3.0, 2: 1.0, 3: 7.0}
KINDS = ["mirrored", "multi_worker"]


def _one_worker_parameter_server(client):
    """One ps and one worker (the workers' steps then run in order, as one process runs them)."""
    info = scheduler_workers(client)
    ordered = sorted(info, key=lambda a: info[a]["name"])
    spec = dd.cluster_resolver.ClusterSpec({"ps": ordered[:1], "worker": ordered[1:2]})
    return dd.ParameterServerStrategy(dd.cluster_resolver.SimpleClusterResolver(spec), client=client)


def _strategy(kind, client):
    if kind == "mirrored":
        return dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client)
    if kind == "central_storage":  # the holder sums the same row-weighted gradients
        return dd.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"], client=client)
    if kind == "elastic":  # epochs in committed steps (no failure here); the client's third worker kept out
        options = dd.ElasticOptions(min_replicas=1, max_replicas=2, commit_every=2)
        return dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client, elastic=options)
    return dd.MultiWorkerMirroredStrategy(client=client)


def uneven_weights(rows=ROWS):
    """Row weights that differ between the replicas' shares of every global batch (first rows light)."""
    position = np.arange(rows) % BATCH
    return np.where(position < BATCH // 3, 0.2, np.where(position < 2 * BATCH // 3, 5.0, 1.0)).astype(np.float32)


# -- Keras 3 -------------------------------------------------------------------------------------------


def _compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def _keras3_pair(strategy):
    with strategy.scope():
        model = _compiled(sequential())
    plain = sequential()
    plain.set_weights(model.get_weights())
    return model, _compiled(plain)


def _assert_keras3_same(model, plain, history, expected, strategy):
    assert max_rel(model.get_weights(), plain.get_weights()) <= RTOL
    assert set(history.history) == set(expected.history)
    for key in expected.history:
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=RTOL, err_msg=key)
    assert_replicas_identical(strategy, model)


@pytest.mark.parametrize("kind", [*KINDS, "central_storage", "elastic"])
def test_keras3_sample_weight_equals_one_process(forked_process_client, kind):
    x, y = dense_data(rows=ROWS)
    w = uneven_weights()
    with _strategy(kind, forked_process_client) as strategy:
        model, plain = _keras3_pair(strategy)
        history = model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            validation_data=(x, y, w))
        expected = plain.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x, y, w))
        _assert_keras3_same(model, plain, history, expected, strategy)
        assert expected.history["accuracy"] != expected.history["weighted_accuracy"]  # the weights count
        got = model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0, return_dict=True)
        want = plain.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0, return_dict=True)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=RTOL), key

        # the same weights as the third part of a dataset's elements: the same training
        model, plain = _keras3_pair(strategy)
        data = dd.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH)
        history = model.fit(data, epochs=2, verbose=0)
        expected = plain.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        _assert_keras3_same(model, plain, history, expected, strategy)


@pytest.mark.parametrize("kind", KINDS)
def test_keras3_class_weight_equals_one_process(forked_process_client, kind):
    x, y = dense_data(rows=ROWS)
    with _strategy(kind, forked_process_client) as strategy:
        model, plain = _keras3_pair(strategy)
        history = model.fit(x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        expected = plain.fit(x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        _assert_keras3_same(model, plain, history, expected, strategy)
        assert expected.history["accuracy"] != expected.history["weighted_accuracy"]

        model, plain = _keras3_pair(strategy)  # a dataset of (x, y) batches: the weights added to each batch
        history = model.fit(dd.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), class_weight=CLASS_WEIGHT,
                            epochs=2, verbose=0)
        expected = plain.fit(x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        _assert_keras3_same(model, plain, history, expected, strategy)


@pytest.mark.parametrize("kind", KINDS)
def test_keras3_validation_split_equals_one_process(forked_process_client, kind):
    x, y = dense_data(rows=ROWS + 16)  # the last 24 rows validate; 72 train in batches of 32, 32, 8
    w = uneven_weights(ROWS + 16)
    with _strategy(kind, forked_process_client) as strategy:
        model, plain = _keras3_pair(strategy)
        history = model.fit(x, y, sample_weight=w, validation_split=0.25, batch_size=BATCH, epochs=2, shuffle=False,
                            verbose=0)
        expected = plain.fit(x, y, sample_weight=w, validation_split=0.25, batch_size=BATCH, epochs=2, shuffle=False,
                             verbose=0)
        _assert_keras3_same(model, plain, history, expected, strategy)
        assert "val_loss" in history.history

        # shuffled: the held-out rows are still the last ones (validated as one process validates them)
        model, plain = _keras3_pair(strategy)
        history = model.fit(x, y, validation_split=0.25, batch_size=BATCH, epochs=1, verbose=0)
        plain.set_weights(model.get_weights())
        tail = plain.evaluate(x[72:], y[72:], batch_size=BATCH, verbose=0, return_dict=True)
        assert history.history["val_loss"][0] == pytest.approx(tail["loss"], rel=RTOL)


def test_keras3_refusals_raise_on_the_client_and_the_strategy_trains_on(forked_process_client):
    x, y = dense_data(rows=ROWS)
    w = uneven_weights()
    with _strategy("mirrored", forked_process_client) as strategy:
        model, plain = _keras3_pair(strategy)
        before = model.get_weights()
        data = dd.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        weighted = dd.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH)
        refused = [
            (dict(x=data, validation_split=0.2), "`validation_split` is only supported for tensors or NumPy arrays"),
            (dict(x=x, y=y, sample_weight=w, class_weight=CLASS_WEIGHT), "cannot `class_weight` and `sample_weight`"),
            (dict(x=weighted, class_weight=CLASS_WEIGHT), "cannot `class_weight` and `sample_weight`"),
            (dict(x=x, y=y, class_weight={"a": 2.0}), r"keys must be class indices \(integers\), got \['a'\]"),
            (dict(x=x, y=[y, y], class_weight=CLASS_WEIGHT), "only supported for Models with a single output"),
            (dict(x=data, sample_weight=w), "put the sample weights in the dataset's"),
            (dict(x=x, y=y, sample_weight=w[:10]), "one weight per row of x"),
        ]
        for arguments, message in refused:
            with pytest.raises(ValueError, match=message):
                model.fit(batch_size=BATCH, epochs=1, verbose=0, **arguments)
        for want, got in zip(before, model.get_weights()):
            np.testing.assert_array_equal(want, got)
        with strategy.scope():  # a loss divided by the weights' sum: each replica would divide by its own
            divided = sequential()
            divided.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"))
        for data_arguments in (dict(x=x, y=y, sample_weight=w), dict(x=weighted)):
            with pytest.raises(NotImplementedError, match="reduction='mean_with_sample_weight'"):
                divided.fit(batch_size=BATCH, epochs=1, verbose=0, **data_arguments)
        history = model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        expected = plain.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        _assert_keras3_same(model, plain, history, expected, strategy)
    with pytest.raises(ValueError, match="`validation_split` is only supported for tensors or NumPy arrays"):
        plain.fit(keras.utils.PyDataset(), validation_split=0.2, verbose=0)  # Keras' own refusal, the same words


def _repeated_batches(x, y, input_context):
    """Every worker's dataset: the rows in order, in global batches, repeated (one worker: one process's batches)."""
    return dd.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()


def test_keras3_parameter_servers_class_weight_equals_one_process(forked_process_client):
    x, y = dense_data(rows=ROWS)  # steps_per_epoch 3: every epoch one pass over the (repeated) rows
    creator = dd.experimental.DatasetCreator(functools.partial(_repeated_batches, x, y))
    with _one_worker_parameter_server(forked_process_client) as strategy:
        for data in (creator, functools.partial(_repeated_batches, x, y)):  # a DatasetCreator, or its dataset_fn
            model, plain = _keras3_pair(strategy)
            history = model.fit(data, class_weight=CLASS_WEIGHT, steps_per_epoch=3, epochs=2, verbose=0)
            expected = plain.fit(x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=2, shuffle=False,
                                 verbose=0)
            assert max_rel(model.get_weights(), plain.get_weights()) <= RTOL
            for key in ("loss", "accuracy", "weighted_accuracy"):
                np.testing.assert_allclose(history.history[key], expected.history[key], rtol=RTOL, err_msg=key)
            assert expected.history["accuracy"] != expected.history["weighted_accuracy"]  # the weights count


def test_keras3_parameter_servers_refuse_what_their_fit_does_not_take(forked_process_client):
    x, y = dense_data(rows=ROWS)
    w = uneven_weights()
    with _one_worker_parameter_server(forked_process_client) as strategy:
        with strategy.scope():
            model = _compiled(sequential())
        before = model.get_weights()
        weighted = dd.experimental.DatasetCreator(
            lambda _context: dd.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH).repeat())
        for arguments, message in [
            (dict(x=x, y=y, validation_split=0.2), "`validation_split` is only supported for tensors or NumPy"),
            (dict(x=x, y=y, sample_weight=w), r"elements carry the sample weights as \(x, y, sample"),
            (dict(x=weighted, class_weight=CLASS_WEIGHT), "cannot `class_weight` and `sample_weight`"),
            (dict(x=functools.partial(_repeated_batches, x, y), class_weight={"a": 1.0}), "keys must be class indices"),
        ]:
            with pytest.raises(ValueError, match=message):
                model.fit(batch_size=BATCH, steps_per_epoch=3, epochs=1, verbose=0, **arguments)
        for want, got in zip(before, model.get_weights()):
            np.testing.assert_array_equal(want, got)


# -- the built-in layers -------------------------------------------------------------------------------


def _builtin_model(weights=None):
    made = builtin.Sequential([builtin.layers.Dense(16, activation="relu", input_shape=(8,)),
                               builtin.layers.Dense(4)])
    made.compile(loss=builtin.losses.SparseCategoricalCrossentropy(from_logits=True),
                 optimizer=builtin.optimizers.SGD(0.1), metrics=["accuracy"])
    made.build((8,))
    if weights is not None:
        made.set_weights(weights)
    return made


def _builtin_pair(strategy):
    plain = _builtin_model()
    with strategy.scope():
        model = _builtin_model(plain.get_weights())
    return model, plain


def _assert_builtin_same(model, plain, history, expected):
    assert max_rel(model.get_weights(), plain.get_weights()) <= RTOL
    assert set(history.history) == set(expected.history)
    for key in expected.history:
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=RTOL, err_msg=key)


@pytest.mark.parametrize("kind", [*KINDS, "central_storage", "elastic"])
def test_builtin_sample_weight_class_weight_and_validation_split_equal_one_process(forked_process_client, kind):
    x, y = dense_data(rows=ROWS + 16)
    w = uneven_weights(ROWS + 16)
    with _strategy(kind, forked_process_client) as strategy:
        for arguments in (dict(sample_weight=w, validation_data=(x, y, w)), dict(class_weight=CLASS_WEIGHT),
                          dict(sample_weight=w, validation_split=0.25)):
            model, plain = _builtin_pair(strategy)
            history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **arguments)
            expected = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **arguments)
            _assert_builtin_same(model, plain, history, expected)
            unweighted = _builtin_model(model.get_weights())  # the loss of one process, unweighted, is another
            assert unweighted.evaluate(x, y, verbose=0) != pytest.approx(
                unweighted.evaluate(x, y, sample_weight=w, verbose=0), rel=1e-3)
        # the last run held out the last 24 rows, with their weights: its last val_loss is their weighted loss
        held_out = plain.evaluate(x[ROWS - 8:], y[ROWS - 8:], sample_weight=w[ROWS - 8:], batch_size=BATCH, verbose=0)
        assert history.history["val_loss"][-1] == pytest.approx(held_out[0], rel=RTOL)  # [loss, accuracy]
        assert model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0) == pytest.approx(
            plain.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0), rel=RTOL)


def test_builtin_weights_under_parameter_servers_equal_one_process(forked_process_client):
    x, y = dense_data(rows=ROWS)  # steps_per_epoch 3: every epoch one pass over the (repeated) rows
    with _one_worker_parameter_server(forked_process_client) as strategy:
        for arguments in (dict(sample_weight=uneven_weights()), dict(class_weight=CLASS_WEIGHT)):
            model, plain = _builtin_pair(strategy)
            history = model.fit(x, y, batch_size=BATCH, steps_per_epoch=3, epochs=2, shuffle=False, verbose=0,
                                **arguments)
            expected = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **arguments)
            _assert_builtin_same(model, plain, history, expected)
        model, plain = _builtin_pair(strategy)  # the class weights mapped over the worker's own dataset
        creator = dd.experimental.DatasetCreator(functools.partial(_repeated_batches, x, y))
        history = model.fit(creator, class_weight=CLASS_WEIGHT, steps_per_epoch=3, epochs=2, verbose=0)
        expected = plain.fit(x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        _assert_builtin_same(model, plain, history, expected)


def test_builtin_refusals_raise_on_the_client_and_the_strategy_trains_on(forked_process_client):
    x, y = dense_data(rows=ROWS)
    w = uneven_weights()
    with _strategy("mirrored", forked_process_client) as strategy:
        model, plain = _builtin_pair(strategy)
        before = model.get_weights()
        data = dd.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        for arguments, message in [
            (dict(x=data, validation_split=0.2), "`validation_split` is only supported for tensors or NumPy arrays"),
            (dict(x=x, y=y, sample_weight=w, class_weight=CLASS_WEIGHT), "cannot `class_weight` and `sample_weight`"),
            (dict(x=x, y=y, class_weight={1.5: 2.0}), r"keys must be class indices"),
        ]:
            with pytest.raises(ValueError, match=message):
                model.fit(batch_size=BATCH, epochs=1, verbose=0, **arguments)
        for want, got in zip(before, model.get_weights()):
            np.testing.assert_array_equal(want, got)
        history = model.fit(data, class_weight=CLASS_WEIGHT, epochs=1, verbose=0)
        expected = plain.fit(x, y, class_weight=CLASS_WEIGHT, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        _assert_builtin_same(model, plain, history, expected)


# -- metrics and weighted_metrics, both adapters against plain Keras 3 ------------------------------------


def _weighted_batches(x, y, w, input_context):
    return dd.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH).repeat()


def _metrics_pair(adapter, strategy):
    """The adapter's model made in ``strategy``'s scope and plain Keras 3's, the same initial weights, both
    compiled with ``metrics=["accuracy"], weighted_metrics=["accuracy"]``."""
    plain = _compiled(sequential())
    if adapter == "keras3":
        with strategy.scope():
            model = _compiled(sequential())
    else:
        with strategy.scope():
            model = builtin.Sequential([builtin.layers.Dense(16, activation="relu", input_shape=(8,)),
                                        builtin.layers.Dense(4)])
            model.compile(loss=builtin.losses.SparseCategoricalCrossentropy(from_logits=True),
                          optimizer=builtin.optimizers.SGD(0.1), metrics=["accuracy"], weighted_metrics=["accuracy"])
            model.build((8,))
    model.set_weights(plain.get_weights())
    return model, plain


@pytest.mark.parametrize("adapter", ["builtin", "keras3"])
@pytest.mark.parametrize("kind", ["mirrored", "parameter_server"])
def test_only_weighted_metrics_take_the_sample_weights_as_in_keras3(forked_process_client, adapter, kind):
    """``metrics`` ignore the sample weights, ``weighted_metrics`` take them (``weighted_accuracy`` beside
    ``accuracy``): fit's and evaluate's logs are plain Keras 3's in one process."""
    x, y = dense_data(rows=ROWS)
    w = uneven_weights()
    held = kind == "parameter_server"
    strategy = _one_worker_parameter_server(forked_process_client) if held else _strategy(kind, forked_process_client)
    with strategy:
        model, plain = _metrics_pair(adapter, strategy)
        if held and adapter == "keras3":  # its workers read a DatasetCreator's (x, y, weight) batches
            data = dict(x=dd.experimental.DatasetCreator(functools.partial(_weighted_batches, x, y, w)),
                        steps_per_epoch=3)
        else:
            data = dict(x=x, y=y, sample_weight=w, batch_size=BATCH, shuffle=False, **(
                dict(steps_per_epoch=3) if held else {}))
        history = model.fit(epochs=2, verbose=0, validation_data=(x, y, w), **data)
        expected = plain.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x, y, w))
        assert set(expected.history) == {f"{prefix}{name}" for prefix in ("", "val_")
                                         for name in ("loss", "accuracy", "weighted_accuracy")}
        assert set(history.history) == set(expected.history)
        for key in expected.history:
            np.testing.assert_allclose(history.history[key], expected.history[key], rtol=RTOL, err_msg=key)
        assert expected.history["accuracy"] != pytest.approx(expected.history["weighted_accuracy"], rel=1e-3)
        want = plain.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0, return_dict=True)
        evaluations = [model.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0, return_dict=True)]
        if adapter == "keras3":  # or the weights in a dataset's elements
            evaluations.append(model.evaluate(dd.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH), verbose=0,
                                              return_dict=True))
        for got in evaluations:
            assert set(got) == set(want)
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=RTOL), key


def test_builtin_metric_names_follow_keras3():
    """Repeated names get ``_1``; a weighted metric whose name is taken is ``weighted_<name>``; the caller's
    metric object is not renamed, and one object given twice keeps two totals."""
    shared = builtin.metrics.SparseCategoricalAccuracy(name="acc")
    made = builtin.Sequential([builtin.layers.Dense(4, input_shape=(8,))])
    made.compile(loss="sparse_categorical_crossentropy", optimizer="sgd", metrics=[shared, "mae", "mae"],
                 weighted_metrics=[shared, "mae", "mse"])
    assert made.metrics_names == ["loss", "acc", "mae", "mae_1", "weighted_acc", "weighted_mae", "mse"]
    assert shared.name == "acc" and made.compiled_metrics[3] is not shared
    with pytest.raises(ValueError, match="`weighted_metrics` argument to be a list"):
        made.compile(loss="sparse_categorical_crossentropy", optimizer="sgd", weighted_metrics="accuracy")


# -- the arguments read once for both adapters (no cluster) ----------------------------------------------


def test_dask_arrays_are_split_and_weighted_lazily_as_numpy_arrays_are():
    import dask.array as da
    from keras.src.trainers.data_adapters.data_adapter_utils import class_weight_to_sample_weights

    from daskdist.training.fit_inputs import class_weights, fit_inputs

    x, y = dense_data(rows=ROWS)
    for labels in (y, y[:, None], np.eye(4, dtype=np.float32)[y]):  # sparse, (rows, 1), one-hot: as Keras reads them
        np.testing.assert_array_equal(class_weights(labels, CLASS_WEIGHT),
                                      class_weight_to_sample_weights(labels, CLASS_WEIGHT))
    eager = fit_inputs(x, y, class_weight=CLASS_WEIGHT, validation_split=0.3)
    lazy = fit_inputs(da.from_array(x, chunks=16), da.from_array(y, chunks=16), class_weight=CLASS_WEIGHT,
                      validation_split=0.3)
    assert all(hasattr(part, "__dask_graph__") for part in (lazy.x, lazy.y, lazy.sample_weight, *lazy.validation_data))
    for want, got in zip((eager.x, eager.y, eager.sample_weight, *eager.validation_data),
                         (lazy.x, lazy.y, lazy.sample_weight, *lazy.validation_data)):
        np.testing.assert_array_equal(want, got.compute())
    np.testing.assert_array_equal(eager.validation_data[0], x[56:])  # floor(80 * 0.7): the last 24 rows held out
    np.testing.assert_array_equal(eager.x, x[:56])
