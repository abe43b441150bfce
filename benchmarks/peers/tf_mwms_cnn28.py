"""One task of TensorFlow's MultiWorkerMirroredStrategy training the tutorial's CNN on 28x28x1 (a benchmark peer).

The model and data of ``benchmarks/keras3_training.py`` (Conv2D(32, 3) -
MaxPooling2D - Flatten - Dense(64) - Dense(10), Adam, sparse CE from logits,
accuracy; synthetic 28x28x1 rows from seed 0) in tf-keras (Keras 2: Keras 3's
``fit`` fails under TF's MWMS), built and compiled in ``strategy.scope()``,
``from_tensor_slices(...).batch(global_batch)`` sharded by data over the tasks,
``CommunicationOptions(implementation=RING)``, one intra-op thread per task
(one CPU replica). ``benchmarks/keras3_vs_tf_mwms.py`` starts the tasks with
``TF_CONFIG`` on localhost.

Prints ``@@tf-mwms-result {"epoch_seconds": [...]}`` (this task's epoch wall times).

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
    parser.add_argument("--samples", type=int, required=True)
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
    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, args.samples).astype(np.int64)
    data_options = tf.data.Options()
    data_options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch).with_options(data_options)
    with strategy.scope():
        model = tutorial_cnn(keras, (28, 28, 1))
    seconds: list[float] = []
    model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[epoch_timer(keras, seconds)])
    print(RESULT_MARKER + json.dumps({"epoch_seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
