"""TensorFlow's "Distributed training with Keras" tutorial with real Keras 3 (torch backend) on daskdist.

The tutorial's code with ``tf.distribute.X`` -> ``daskdist.X`` and ``tf.data``
-> ``daskdist.data`` changed, and nothing else: a ``dd.MirroredStrategy`` over
an embedded local Dask cluster, an input pipeline over Dask arrays that stay
on the workers, ``keras.Sequential`` built and compiled in
``strategy.scope()``, ``model.fit`` with Keras' own TensorBoard,
ModelCheckpoint and LearningRateScheduler callbacks and a custom one,
restoring the last checkpoint, ``model.evaluate``, ``model.save`` to a
``.keras`` file, and loading it back with and without the scope. Each replica
runs Keras' forward and backward on its share of every global batch; daskdist
all-reduces the gradients before Keras' ``optimizer.apply``.

Data: ``--data mnist.npz`` reads MNIST in Keras' format; by default
scikit-learn's handwritten digits (8x8) are used, with the same model.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")  # Keras 3's default backend (TensorFlow) is not daskdist's

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _digits import load_data, tutorial_datasets  # noqa: E402  (examples/_digits.py: the tutorial's data)

import daskdist as dd  # noqa: E402


def main(args: argparse.Namespace) -> float:
    keras.utils.set_random_seed(args.seed)
    (train_images, train_labels), (test_images, test_labels), pixel_max = load_data(args.data)
    devices = [f"/cpu:{i}" for i in range(args.replicas)] if args.replicas else None
    strategy = dd.MirroredStrategy(devices=devices)
    print(f"Number of devices: {strategy.num_replicas_in_sync} (Keras backend: {keras.backend.backend()})")

    BATCH_SIZE = args.batch_per_replica * strategy.num_replicas_in_sync
    train_dataset, eval_dataset = tutorial_datasets(strategy, (train_images, train_labels), (test_images, test_labels),
                                                    pixel_max, BATCH_SIZE)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input(train_images.shape[1:]),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(), metrics=["accuracy"])

    checkpoint_dir = os.path.join(args.workdir, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.weights.h5")
    log_dir = os.path.join(args.workdir, "logs")
    for directory in (checkpoint_dir, log_dir):
        shutil.rmtree(directory, ignore_errors=True)

    def decay(epoch):
        return 3e-3 if epoch < 6 else (1e-3 if epoch < 10 else 3e-4)

    class PrintLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(f"\nLearning rate for epoch {epoch + 1} is {float(model.optimizer.learning_rate):.6f}")

    callbacks = [
        keras.callbacks.TensorBoard(log_dir=log_dir),
        keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]

    history = model.fit(train_dataset, epochs=args.epochs, callbacks=callbacks, verbose=args.verbose)
    for epoch, (loss, acc) in enumerate(zip(history.history["loss"], history.history["accuracy"])):
        print(f"epoch {epoch + 1:2d}: loss {loss:.4f}  accuracy {acc:.4f}")

    last = sorted(os.listdir(checkpoint_dir), key=lambda name: int(name.split("_")[1].split(".")[0]))[-1]
    model.load_weights(os.path.join(checkpoint_dir, last))
    eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)
    print(f"Eval loss: {eval_loss:.4f}, Eval accuracy: {eval_acc:.4f}")

    path = os.path.join(args.workdir, "model.keras")
    model.save(path)  # a plain .keras file: keras.models.load_model reads it without daskdist
    unreplicated = keras.models.load_model(path)
    test_x = (test_images / pixel_max).astype(np.float32)
    _, plain_acc = unreplicated.evaluate(test_x, test_labels, verbose=0)
    print(f"Reloaded without a scope: eval accuracy {plain_acc:.4f}")
    with strategy.scope():
        replicated = keras.models.load_model(path)
        _, replicated_acc = replicated.evaluate(eval_dataset, verbose=0)
    print(f"Reloaded in the scope ({strategy.num_replicas_in_sync} replicas): eval accuracy {replicated_acc:.4f}")
    strategy.close()
    return float(eval_acc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="path to mnist.npz (Keras' format); default: scikit-learn's digits")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--replicas", type=int, default=None, help="CPU replicas (default: one per core, at least 2)")
    parser.add_argument("--batch-per-replica", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=".", help="where logs, checkpoints and the saved model go")
    parser.add_argument("--verbose", type=int, default=2)
    parser.add_argument("--target", type=float, default=None, help="fail (exit 1) below this test accuracy")
    arguments = parser.parse_args()
    if arguments.batch_per_replica is None:
        arguments.batch_per_replica = 64 if arguments.data else 16
    if arguments.target is None:
        arguments.target = 0.985 if arguments.data else 0.95
    logging.basicConfig(level=logging.WARNING)
    accuracy = main(arguments)
    if accuracy < arguments.target:
        print(f"FAILED: test accuracy {accuracy:.4f} is below the target {arguments.target}")
        sys.exit(1)
    print(f"OK: test accuracy {accuracy:.4f} (target {arguments.target})")
