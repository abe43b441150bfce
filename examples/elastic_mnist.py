"""Elastic training: the tutorial's model keeps training when a worker is killed mid-epoch.

Starts a local Dask cluster of worker processes (each with its nanny), trains
the tutorial's CNN on scikit-learn's digits under
``dd.MirroredStrategy(elastic=dd.ElasticOptions(...))`` and, during the
second epoch, kills one worker process with SIGKILL. ``fit`` goes on: the
survivors re-form the group, go back to the newest commit they all hold, and
train the rest of the epoch over themselves, at the same global batch, every
sample of the epoch used exactly once. The nanny restarts the killed worker;
once its ``cooldown`` is over it is admitted again at a commit boundary and
trains with the others.

    python examples/elastic_mnist.py            # 3 workers, one killed in epoch 2
    python examples/elastic_mnist.py --no-kill  # the same run, uninterrupted

Prints the membership changes (``history.elastic_events``), the ledger's
count of committed rows per epoch, and the test accuracy.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import daskdist as dd
from daskdist import keras


def load_digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's 8x8 digits, scaled to [0, 1], with a channel axis; 80 % train, 20 % test."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(labels))
    return (images[:split], labels[:split]), (images[split:], labels[split:])


class KillAWorker(keras.callbacks.Callback):
    """SIGKILL one worker process shortly after epoch ``epoch`` begins (its nanny restarts it)."""

    def __init__(self, client: Client, epoch: int, delay: float):
        super().__init__()
        self.client, self.epoch, self.delay = client, epoch, delay
        self.killed: str | None = None

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self.epoch or self.killed is not None:
            return
        pids = self.client.run(os.getpid)
        victim = sorted(pids)[-1]
        self.killed = victim
        threading.Timer(self.delay, os.kill, (pids[victim], signal.SIGKILL)).start()
        print(f"-- epoch {epoch + 1}: killing worker {victim} (pid {pids[victim]}) in {self.delay} s")


def main(args: argparse.Namespace) -> float:
    (train_x, train_y), (test_x, test_y) = load_digits()
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                           silence_logs=logging.ERROR)
    client = Client(cluster)
    options = dd.ElasticOptions(min_replicas=2, commit_every=1, cooldown=args.cooldown, admit_every="1s")
    strategy = dd.MirroredStrategy(client=client, elastic=options)
    print(f"{strategy.num_replicas_in_sync} replicas; dashboard: {strategy.dashboard_link}")

    def on_cluster(array: np.ndarray) -> da.Array:
        return client.persist(da.from_array(array, chunks=(len(array) // (2 * args.workers),) + array.shape[1:]))

    global_batch = 16 * strategy.num_replicas_in_sync
    train = (dd.data.Dataset.from_dask((on_cluster(train_x), on_cluster(train_y)))
             .shuffle(10_000, seed=0).batch(global_batch))
    test = dd.data.Dataset.from_tensor_slices((test_x, test_y)).batch(global_batch)

    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Conv2D(32, 3, activation="relu", input_shape=train_x.shape[1:]),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(3e-3), metrics=["accuracy"])

    callbacks = [] if args.no_kill else [KillAWorker(client, epoch=1, delay=args.kill_after)]
    history = model.fit(train, epochs=args.epochs, callbacks=callbacks, verbose=args.verbose)

    for event in history.elastic_events:
        print(f"generation {event['generation']}: {event['action']}, {len(event['members'])} replicas "
              f"(lost {event['lost']}, admitted {event['admitted']}) at commit {tuple(event['commit'])}, "
              f"in {event['seconds']:.2f} s")
    ledger = history.elastic.ledger
    for epoch in range(args.epochs):
        rows = ledger.positions(epoch)
        print(f"epoch {epoch + 1:2d}: loss {history.history['loss'][epoch]:.4f}, "
              f"{len(rows)} rows committed ({len(set(rows.tolist()))} distinct of {len(train_y)})")
    _, accuracy = model.evaluate(test, verbose=0)
    print(f"{strategy.num_replicas_in_sync} replicas at the end; test accuracy {accuracy:.4f}")
    strategy.close()
    client.close()
    cluster.close()
    return float(accuracy)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--kill-after", type=float, default=0.5, help="seconds into epoch 2 before the kill")
    parser.add_argument("--cooldown", default="2s", help="how long the killed worker is kept out once restarted")
    parser.add_argument("--no-kill", action="store_true", help="train without killing a worker")
    parser.add_argument("--verbose", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.95, help="fail (exit 1) below this test accuracy")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sys.exit(0 if main(arguments) >= arguments.target else 1)
