"""TensorFlow's own MultiWorkerMirroredStrategy training the tutorial's CNN with tf-keras (a benchmark peer).

One TF task per CPU replica, run inside its namespace host with ``TF_CONFIG``
pointing at the tasks' addresses (``benchmarks/multihost_training.py`` starts
them). The model, data and input pipeline are those of
``examples/mnist_mirrored.py`` on scikit-learn's digits (8x8):
``from_tensor_slices(...).map(scale).cache().shuffle(10_000, seed=0).batch(global_batch)``,
sharded by data across the tasks (``AutoShardPolicy.DATA``), the CNN built and
compiled in ``strategy.scope()`` (Adam, sparse CE from logits, accuracy),
``fit`` with ``verbose=0``. tf-keras (Keras 2), because Keras 3's ``fit`` fails
under TF's MWMS. ``CommunicationOptions(implementation=RING)``, as the
all-reduce peer. Each task runs with one intra-op thread (one CPU replica).

Prints ``RESULT_MARKER`` and ``{"epoch_seconds": [...], "samples": n, "threads": "...", "blas": "..."}``
(this task's epoch wall times, from ``on_epoch_begin`` to ``on_epoch_end``).

    TF_CONFIG=... python benchmarks/peers/tf_mwms_training.py --global-batch 64 --epochs 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf-keras (Keras 2)

REPO = Path(__file__).resolve().parents[2]
RESULT_MARKER = "@@allreduce-result "

__all__ = ["main"]


def tutorial_cnn(keras: Any, input_shape: tuple[int, ...]) -> Any:
    """The tutorial's CNN in tf-keras, compiled as ``examples/mnist_mirrored.py`` compiles it (call in a scope)."""
    model = keras.Sequential([
        keras.layers.Conv2D(32, 3, activation="relu", input_shape=input_shape),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def epoch_timer(keras: Any, seconds: list[float]) -> Any:
    """A tf-keras callback appending each epoch's wall time (``on_epoch_begin`` to ``on_epoch_end``) to ``seconds``."""

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)

    return EpochTimer()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "examples"))
    import tensorflow as tf
    import tf_keras as keras
    from mnist_mirrored import load_data  # the tutorial's data: scikit-learn digits, same split and order

    tf.config.threading.set_intra_op_parallelism_threads(1)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    (images, labels), _, pixel_max = load_data(None)

    def scale(image, label):
        return tf.cast(image, tf.float32) / pixel_max, label

    data_options = tf.data.Options()
    data_options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = (tf.data.Dataset.from_tensor_slices((images, labels)).map(scale).cache()
               .shuffle(10_000, seed=0).batch(args.global_batch).with_options(data_options))
    with strategy.scope():
        model = tutorial_cnn(keras, images.shape[1:])
    seconds: list[float] = []
    history = model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[epoch_timer(keras, seconds)])
    from threadpoolctl import threadpool_info

    blas = ", ".join(f"{i['internal_api']} {i.get('architecture', '?')} x{i['num_threads']}"
                     for i in threadpool_info() if i["user_api"] == "blas")
    print(RESULT_MARKER + json.dumps({
        "epoch_seconds": seconds, "samples": int(len(labels)), "loss": history.history["loss"],
        "replicas": strategy.num_replicas_in_sync, "blas": blas or "none loaded",
        "threads": f"intra-op {tf.config.threading.get_intra_op_parallelism_threads()}"}), flush=True)


if __name__ == "__main__":
    main()
