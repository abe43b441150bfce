"""MultiWorkerMirroredStrategy on a Dask cluster you already run: ``fit``, then a custom loop with ``GradientTape``.

Start a cluster as a Dask user does (every host's workers, and the
scheduler, need daskdist installed in their environment: the replicas run
daskdist's code there)::

    dask scheduler                                   # prints its address, e.g. tcp://10.0.0.5:8786
    dask worker tcp://10.0.0.5:8786 --nthreads 1     # on each host, once per replica (or --nworkers N)

then, from any machine that reaches the scheduler::

    python examples/multi_worker.py --scheduler tcp://10.0.0.5:8786

Without ``--scheduler`` a ``LocalCluster`` of two worker processes is started.
The script puts scikit-learn's digits on the cluster (a persisted Dask
array), trains a small classifier with ``model.fit`` on every worker of
every host (a TF "worker" is a host; each Dask worker on it is a replica),
continues with a custom training loop (``strategy.run``, ``dd.GradientTape``,
loss scaled by the global batch, ``strategy.reduce``), and evaluates on
held-out digits. It exits with status 1 below 90% accuracy.
"""

from __future__ import annotations

import argparse
import logging
import sys

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster
from sklearn.datasets import load_digits

import daskdist as dd
from daskdist import keras

logger = logging.getLogger("multi_worker")

PER_REPLICA_BATCH = 32


def load_data():
    """Digits (1797 images of 8x8) as float32 rows in [0, 1]: 1500 to train on, the rest held out."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def train(client: Client, epochs: int = 8) -> dict:
    """Train on the cluster behind ``client``; returns the losses and the held-out accuracy."""
    (x_train, y_train), (x_test, y_test) = load_data()
    # the data lives on the cluster, as a Dask user's data does: persisted partitions on the workers
    x = client.persist(da.from_array(x_train, chunks=300))
    y = client.persist(da.from_array(y_train, chunks=300))

    strategy = dd.MultiWorkerMirroredStrategy(client=client)
    try:
        logger.info("hosts (TF workers): %s; replicas in sync: %d",
                    strategy.cluster_resolver.cluster_spec().as_dict().get("worker"), strategy.num_replicas_in_sync)
        global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
        dataset = dd.data.Dataset.from_dask((x, y)).shuffle(1500, seed=0).batch(global_batch)

        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(64, activation="relu", input_shape=(64,)),
                                      keras.layers.Dense(10)])
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
            loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
            optimizer = keras.optimizers.SGD(0.05)

        history = model.fit(dataset, epochs=epochs, verbose=0)
        logger.info("fit: loss %.3f -> %.3f", history.history["loss"][0], history.history["loss"][-1])

        def train_step(inputs):
            features, labels = inputs
            with dd.GradientTape() as tape:
                logits = model(features, training=True)
                loss = dd.nn.compute_average_loss(loss_object(labels, logits), global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # sums the replicas' gradients
            return loss

        custom_losses = []
        for batch in strategy.experimental_distribute_dataset(dataset):
            per_replica = strategy.run(train_step, args=(batch,))
            custom_losses.append(float(strategy.reduce(dd.ReduceOp.SUM, per_replica, axis=None)))
        logger.info("custom loop: mean loss %.3f over %d steps", float(np.mean(custom_losses)), len(custom_losses))

        predictions = model.predict(x_test)
        accuracy = float(np.mean(predictions.argmax(axis=1) == y_test))
    finally:
        strategy.close()
    return {"losses": history.history["loss"], "custom_losses": custom_losses, "accuracy": accuracy,
            "replicas": strategy.num_replicas_in_sync}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="address of a running Dask scheduler (default: a LocalCluster)")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.scheduler:
        with Client(args.scheduler) as client:
            result = train(client, args.epochs)
    else:
        with LocalCluster(n_workers=2, threads_per_worker=1) as cluster, Client(cluster) as client:
            result = train(client, args.epochs)
    logger.info("held-out accuracy %.3f on %d replicas", result["accuracy"], result["replicas"])
    return 0 if result["accuracy"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
