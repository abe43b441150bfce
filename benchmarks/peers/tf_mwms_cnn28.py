"""One task of TensorFlow's MultiWorkerMirroredStrategy training the tutorial's CNN on 28x28x1 (a benchmark peer).

The model and data of ``benchmarks/keras3_training.py`` (Conv2D(32, 3) -
MaxPooling2D - Flatten - Dense(64) - Dense(10), Adam, sparse CE from logits,
accuracy; synthetic 28x28x1 rows from seed 0) in tf-keras (Keras 2: Keras 3's
``fit`` fails under TF's MWMS), built and compiled in ``strategy.scope()``,
``from_tensor_slices(...).batch(global_batch)`` sharded by data over the tasks,
``CommunicationOptions(implementation=RING)``, one intra-op thread per task
(one CPU replica). ``benchmarks/keras3_vs_tf_mwms.py`` starts the tasks with
``TF_CONFIG`` on localhost.

Prints ``@@tf-mwms-result {"epoch_seconds": [...]}`` (this task's epoch wall times). With ``--data``
(an ``.npz`` of ``x_train``, ``y_train``, ``x_test``, ``y_test``, written by
``benchmarks/keras3_time_to_accuracy.py``) it trains on those rows instead,
validates on the test rows after each epoch and stops once the validation
accuracy reaches ``--target``; it adds ``"seconds"`` (from the start of
``fit`` to each epoch's end) and ``"val_accuracy"`` per epoch.

    TF_CONFIG=... python benchmarks/peers/tf_mwms_cnn28.py --samples 4096 --global-batch 128 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf-keras (Keras 2)

from tf_mwms_training import epoch_timer, tutorial_cnn  # noqa: E402  (this folder is on sys.path when run)

RESULT_MARKER = "@@tf-mwms-result "


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=0)
    parser.add_argument("--data", help="an .npz with x_train, y_train, x_test, y_test (time to --target)")
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    data_options = tf.data.Options()
    data_options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    if args.data:
        with np.load(args.data) as f:
            x, y, x_test, y_test = (f[k] for k in ("x_train", "y_train", "x_test", "y_test"))
        validation = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.global_batch)
        validation = validation.with_options(data_options)
    else:
        rng = np.random.default_rng(0)
        x = rng.random((args.samples, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, args.samples).astype(np.int64)
        validation = None
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch).with_options(data_options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = tutorial_cnn(keras, (28, 28, 1))
    seconds: list[float] = []
    callbacks = [epoch_timer(keras, seconds)]
    reached: dict[str, list[float]] = {"seconds": [], "val_accuracy": []}
    if validation is not None:
        callbacks.append(_until(keras, args.target, reached))
    model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks, validation_data=validation)
    print(RESULT_MARKER + json.dumps({"epoch_seconds": seconds, **reached}), flush=True)


def _until(keras, target: float, reached: dict[str, list[float]]):
    """A callback keeping the time since ``fit`` began and the validation accuracy at each epoch's end; it stops
    training once that accuracy reaches ``target``."""
    import time

    class Until(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            reached["seconds"].append(time.perf_counter() - self.start)
            reached["val_accuracy"].append(float(logs["val_accuracy"]))
            if reached["val_accuracy"][-1] >= target:
                self.model.stop_training = True

    return Until()


if __name__ == "__main__":
    main()
