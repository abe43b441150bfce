"""Dask dataframes into ``fit`` on real clusters: derived arrays read as arrays, dataframes refused on the client."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

import daskdist as dd

pd = pytest.importorskip("pandas")
ddf = pytest.importorskip("dask.dataframe")
pytest.importorskip("sklearn")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "dataframe_regression.py"


def _example():
    spec = importlib.util.spec_from_file_location("dataframe_regression", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _least_squares_held_out_mse(train_frame, held_out_frame) -> float:
    """The mean squared error on the held-out rows of the least-squares fit to the training rows."""
    def design(data):
        return np.column_stack([data.drop(columns="target").to_numpy(), np.ones(len(data))])

    data, held_out = train_frame.compute(), held_out_frame.compute()
    coef, *_ = np.linalg.lstsq(design(data), data["target"].to_numpy(), rcond=None)
    return float(np.mean((design(held_out) @ coef - held_out["target"].to_numpy()) ** 2))


def test_the_dataframe_regression_example_trains_on_the_cluster(process_client):
    example = _example()
    result = example.train(process_client, epochs=40)
    train_frame, held_out = example.split_frame(example.load_frame())
    assert 0.1 < len(held_out) / (len(train_frame) + len(held_out)) < 0.3  # rows the model never saw
    best = _least_squares_held_out_mse(train_frame, held_out)
    assert result["last_loss"] < result["first_loss"]
    assert result["mse"] < best * 1.1, (result, best)  # close to the least-squares fit, on held-out rows


def test_arrays_derived_from_a_persisted_dataframe_are_read_as_arrays(threaded_client):
    frame = threaded_client.persist(ddf.from_pandas(
        pd.DataFrame({"a": np.arange(40.0), "b": np.arange(40.0) * 2, "target": np.arange(40.0)}), npartitions=4))
    with threaded_client.as_current():
        x = frame[["a", "b"]].astype("float32").to_dask_array(lengths=True)
        y = frame["target"].astype("float32").to_dask_array(lengths=True)
    dataset = dd.data.Dataset.from_dask((x, y)).batch(8)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        seen = []
        for features, target in strategy.experimental_distribute_dataset(
                dataset, dd.InputOptions(experimental_split="global")):  # TF's exact batches, checked in order
            kinds = strategy.run(lambda f, t: f"{type(f).__name__} {f.dtype} {f.shape[1:]} {type(t).__name__}",
                                 args=(features, target))
            assert set(strategy.experimental_local_results(kinds)) <= {"ndarray float32 (2,) ndarray"}
            out = strategy.run(lambda f, t: np.column_stack([f, t]), args=(features, target))
            seen.extend(row.tolist() for part in strategy.experimental_local_results(out) for row in part)
    assert seen == [[i, 2 * i, i] for i in range(40)]  # the global batches in order


def test_a_dataframe_given_to_a_one_input_model_is_refused_on_the_client(threaded_client):
    frame = threaded_client.persist(ddf.from_pandas(
        pd.DataFrame({"a": np.arange(40.0), "b": np.arange(40.0), "target": np.arange(40.0)}), npartitions=4))
    with threaded_client.as_current():
        y = frame["target"].astype("float32").to_dask_array(lengths=True)
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        with strategy.scope():
            model = dd.keras.Sequential([dd.keras.layers.Dense(1, input_shape=(2,))])
            model.compile(optimizer="sgd", loss="mse")
        before = [len(steps) for steps in strategy.step_timings()]
        columns = dd.data.Dataset.from_dask((frame[["a", "b"]], y)).batch(8)
        with pytest.raises(TypeError, match=r"one array x of shape \(None, 2\).*dict of 2 columns \(a, b\).*to_dask_array"):
            model.fit(columns, epochs=1, verbose=0)
        assert [len(steps) for steps in strategy.step_timings()] == before  # no replica ran a step
        with pytest.raises(ValueError, match=r"shape \(None, 2\); the dataset's x has shape \(None, 3\)"):
            model.fit(dd.data.Dataset.from_tensor_slices((np.zeros((8, 3)), np.zeros(8))).batch(4), verbose=0)
        stacked = columns.map(lambda x, t: (np.stack([x["a"], x["b"]], axis=-1).astype("float32"), t))
        history = model.fit(stacked, epochs=2, verbose=0)  # the way the message gives
        assert len(history.history["loss"]) == 2
