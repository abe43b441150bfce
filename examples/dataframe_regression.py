"""Regression on a Dask dataframe: scikit-learn's diabetes data -> Dask dataframe -> ``model.fit``.

The most common way Dask users hold training data is a dataframe persisted
on the cluster. Its feature columns become one float32 array (a Dask array
derived from the persisted dataframe, read by the replicas as that array),
the target another; ``Dataset.from_dask`` pairs them and ``fit`` trains a
linear model data-parallel on the replicas, on about 80% of the rows; the
mean squared error is measured on the other 20%, held out. Passing the dataframe itself
(dict-of-columns elements, as in TensorFlow) to a one-input model is refused
on the client before training, with the way to pass it in the message.

Run: ``python examples/dataframe_regression.py`` (starts a LocalCluster), or
``--scheduler tcp://host:8786`` for an existing cluster.
"""

from __future__ import annotations

import argparse
import logging

import dask.dataframe as ddf
import numpy as np
from distributed import Client, LocalCluster
from sklearn.datasets import load_diabetes

import daskdist as dd

logger = logging.getLogger("dataframe_regression")


def load_frame(npartitions: int = 4):
    """The diabetes data (442 rows, 10 standardised features) as a Dask dataframe, target scaled to unit variance."""
    frame = load_diabetes(as_frame=True).frame
    frame["target"] = (frame["target"] - frame["target"].mean()) / frame["target"].std()
    return ddf.from_pandas(frame, npartitions=npartitions)


def split_frame(frame):
    """Rows for training and held-out rows (about 80% / 20%, the same split every run)."""
    train_part, held_out = frame.random_split([0.8, 0.2], random_state=0)
    return train_part, held_out


def train(client: Client, epochs: int = 60, batch_size: int = 32) -> dict:
    """Fit a linear model on the cluster; returns the first and last epoch's loss and the held-out MSE.

    The model trains on the training rows only; the mean squared error is
    computed on the held-out rows, which it never saw.
    """
    frame, held_out = (client.persist(part) for part in split_frame(load_frame()))
    features = [c for c in frame.columns if c != "target"]
    with client.as_current():  # lengths=True computes the partitions' lengths on this client's cluster
        x = frame[features].astype("float32").to_dask_array(lengths=True)
        y = frame["target"].astype("float32").to_dask_array(lengths=True)
    dataset = dd.data.Dataset.from_dask((x, y)).shuffle(512, seed=0).batch(batch_size)

    with dd.MirroredStrategy(client=client) as strategy:
        with strategy.scope():
            model = dd.keras.Sequential([dd.keras.layers.Dense(1, input_shape=(len(features),))])
            model.compile(optimizer=dd.keras.optimizers.Adam(learning_rate=0.05), loss="mse")
        history = model.fit(dataset, epochs=epochs, verbose=0)
        try:  # the dataframe itself: dict-of-columns elements, refused before any replica starts training
            model.fit(dd.data.Dataset.from_dask((frame[features], y)).batch(batch_size), epochs=1, verbose=0)
        except TypeError as e:
            logger.info("A dataframe as x is refused on the client: %s", e)
        held_out_rows = client.compute(held_out, sync=True)
        predictions = model.predict(held_out_rows[features].to_numpy(np.float32))[:, 0]
    mse = float(np.mean((predictions - held_out_rows["target"].to_numpy()) ** 2))
    losses = history.history["loss"]
    return {"first_loss": losses[0], "last_loss": losses[-1], "mse": mse}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="address of an existing Dask scheduler (default: a LocalCluster)")
    parser.add_argument("--epochs", type=int, default=60)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.scheduler:
        with Client(args.scheduler) as client:
            result = train(client, args.epochs)
    else:
        with LocalCluster(n_workers=2, threads_per_worker=1) as cluster, Client(cluster) as client:
            result = train(client, args.epochs)
    logger.info("loss %.3f -> %.3f; mean squared error on held-out rows %.3f (target variance 1)",
                result["first_loss"], result["last_loss"], result["mse"])


if __name__ == "__main__":
    main()
