"""The MirroredStrategy Keras tutorial, on daskdist (the README's ``make run``).

Follows TensorFlow's "Distributed training with Keras" tutorial step by step:
a strategy over an embedded local Dask cluster, an input pipeline
(``map(scale).cache().shuffle().batch()``) over Dask arrays that stay on the
workers, a model built and compiled in ``strategy.scope()``, ``fit`` with
TensorBoard, ModelCheckpoint, LearningRateScheduler and a PrintLR callback,
restore of the latest checkpoint, evaluation, and saving/reloading the model
with and without a scope.

``--strategy central-storage`` runs the same tutorial under
``dd.experimental.CentralStorageStrategy`` (variables stored once, the
optimizer run once per step where they are held).

Data: ``--data mnist.npz`` reads MNIST in Keras' format (x_train, y_train,
x_test, y_test); by default the real handwritten digits that scikit-learn
ships (8x8 images) are used, with the same model adapted to the input size.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

from _digits import load_data, tutorial_datasets  # examples/_digits.py: the tutorial's data and pipelines

import daskdist as dd
from daskdist import keras


def main(args: argparse.Namespace) -> float:
    (train_images, train_labels), (test_images, test_labels), pixel_max = load_data(args.data)
    devices = [f"/cpu:{i}" for i in range(args.replicas)] if args.replicas else None

    if args.strategy == "central-storage":  # variables stored once, in replica 0's worker memory
        strategy = dd.experimental.CentralStorageStrategy(compute_devices=devices)
    else:
        strategy = dd.MirroredStrategy(devices=devices)
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    print(f"Dask dashboard: {strategy.dashboard_link}")

    # -- input pipeline over Dask arrays living on the cluster's workers --------------------
    BATCH_SIZE_PER_REPLICA = args.batch_per_replica
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    train_dataset, eval_dataset = tutorial_datasets(strategy, (train_images, train_labels), (test_images, test_labels),
                                                    pixel_max, BATCH_SIZE)

    # -- model, built and compiled in the strategy's scope -------------------------------
    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Conv2D(32, 3, activation="relu", input_shape=train_images.shape[1:]),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(), metrics=["accuracy"])

    # -- callbacks --------------------------------------------------------------------
    checkpoint_dir = os.path.join(args.workdir, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")
    log_dir = os.path.join(args.workdir, "logs")
    for directory in (checkpoint_dir, log_dir):
        shutil.rmtree(directory, ignore_errors=True)

    def decay(epoch):
        if epoch < 3:
            return 1e-3
        elif 3 <= epoch < 7:
            return 1e-4
        else:
            return 1e-5

    if not args.data:  # digits: ~10x fewer steps per epoch than MNIST, so a gentler decay keeps learning
        def decay(epoch):  # noqa: F811
            return 3e-3 if epoch < 6 else (1e-3 if epoch < 10 else 3e-4)

    class PrintLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(f"\nLearning rate for epoch {epoch + 1} is {model.optimizer.lr.numpy()}")

    callbacks = [
        keras.callbacks.TensorBoard(log_dir=log_dir),
        keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]

    # -- train, restore, evaluate ---------------------------------------------------------
    history = model.fit(train_dataset, epochs=args.epochs, callbacks=callbacks, verbose=args.verbose)
    for epoch, (loss, acc) in enumerate(zip(history.history["loss"], history.history["accuracy"])):
        print(f"epoch {epoch + 1:2d}: loss {loss:.4f}  accuracy {acc:.4f}")

    model.load_weights(dd.train.latest_checkpoint(checkpoint_dir))
    eval_loss, eval_acc = model.evaluate(eval_dataset)
    print(f"Eval loss: {eval_loss:.4f}, Eval accuracy: {eval_acc:.4f}")
    print(f"TensorBoard logs: {sorted(os.listdir(log_dir))} in {log_dir}")
    print(f"Checkpoints: {sorted(os.listdir(checkpoint_dir))[:4]} ...")

    # -- save, reload without and with a scope --------------------------------------------
    path = os.path.join(args.workdir, "saved_model")
    shutil.rmtree(path, ignore_errors=True)
    model.save(path)

    unreplicated = keras.models.load_model(path)
    unreplicated.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    eval_loss, eval_acc = unreplicated.evaluate(eval_dataset)
    print(f"Reloaded without a scope: eval loss {eval_loss:.4f}, eval accuracy {eval_acc:.4f}")

    with strategy.scope():
        replicated = keras.models.load_model(path)
        replicated.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
        eval_loss, eval_acc = replicated.evaluate(eval_dataset)
        print(f"Reloaded in the scope ({strategy.num_replicas_in_sync} replicas): "
              f"eval loss {eval_loss:.4f}, eval accuracy {eval_acc:.4f}")

    strategy.close()
    return float(eval_acc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="path to mnist.npz (Keras' format); default: scikit-learn's digits")
    parser.add_argument("--strategy", choices=["mirrored", "central-storage"], default="mirrored",
                        help="MirroredStrategy (the tutorial's) or experimental.CentralStorageStrategy")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--replicas", type=int, default=None, help="CPU replicas (default: one per core, at least 2)")
    parser.add_argument("--batch-per-replica", type=int, default=None)
    parser.add_argument("--workdir", default=".", help="where logs, checkpoints and the saved model go")
    parser.add_argument("--verbose", type=int, default=1)
    parser.add_argument("--target", type=float, default=None, help="fail (exit 1) below this test accuracy")
    arguments = parser.parse_args()
    if arguments.batch_per_replica is None:
        arguments.batch_per_replica = 64 if arguments.data else 16
    if arguments.target is None:
        arguments.target = 0.985 if arguments.data else 0.97
    logging.basicConfig(level=logging.WARNING)
    accuracy = main(arguments)
    if accuracy < arguments.target:
        print(f"FAILED: test accuracy {accuracy:.4f} is below the target {arguments.target}")
        sys.exit(1)
    print(f"OK: test accuracy {accuracy:.4f} (target {arguments.target})")
