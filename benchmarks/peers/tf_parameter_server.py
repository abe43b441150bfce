"""TensorFlow's own ParameterServerStrategy + ClusterCoordinator on the PS benchmark's model (a benchmark peer).

An in-process cluster (TF's tutorial ``create_in_process_cluster``): ``--workers``
worker and ``--ps`` ps ``tf.distribute.Server``s in this process, gRPC on
localhost, the coordinator (chief) in this process too. The model and the
closure are those of ``benchmarks/parameter_server.py``: the digits softmax
classifier (kernel 64x10 and bias, placed on the ps round-robin), a
per-worker dataset (``from_tensor_slices`` of scikit-learn's digits, sharded
by worker, batched, repeated), and a ``tf.function`` step that reads both
variables, computes the softmax gradient by hand and ``assign_sub``s it.

After ``--warmup`` closures, ``--closures`` closures are scheduled and
joined: committed closures per second. Also the empty closure's rate.

``--model mlp``: instead of the hand-written closure, the tutorial's MLP in
tf-keras (Keras 2; Dense(64, relu) - Dense(10), Adam, sparse CE from logits,
accuracy), built and compiled in ``strategy.scope()`` and trained with
``model.fit(DatasetCreator(dataset_fn), steps_per_epoch=...)`` as TF's
parameter-server tutorial does (``fit`` makes its own ``ClusterCoordinator``,
one step per closure: ``steps_per_execution`` 1). One warm-up epoch of
``--warmup`` steps is not timed; then ``--closures`` steps in epochs of
``--steps-per-epoch``, timed from ``on_epoch_begin`` to ``on_epoch_end``
(``peers/tf_mwms_training.epoch_timer``): closures/s of ``fit``.
``benchmarks/parameter_server.py --parts keras3`` runs the same model in
Keras 3 under daskdist's ParameterServerStrategy against it.

Prints ``RESULT_MARKER`` and ``{"rate": ..., "empty_rate": ..., "accuracy": ...}`` (``--model mlp``:
``{"rate": ..., "epoch_seconds": [...], "accuracy": ...}``).

    python benchmarks/peers/tf_parameter_server.py --workers 2 --ps 2 --closures 400 --batch 32
    python benchmarks/peers/tf_parameter_server.py --workers 2 --ps 2 --closures 400 --batch 32 --model mlp
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf-keras (Keras 2)

RESULT_MARKER = "@@ps-result "

__all__ = ["RESULT_MARKER", "main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _in_process_cluster(tf: object, num_workers: int, num_ps: int) -> object:
    """TF's tutorial in-process cluster: servers for every worker and ps, started in this process."""
    cluster = {"worker": [f"localhost:{_free_port()}" for _ in range(num_workers)],
               "ps": [f"localhost:{_free_port()}" for _ in range(num_ps)]}
    spec = tf.train.ClusterSpec(cluster)  # type: ignore[attr-defined]
    config = tf.compat.v1.ConfigProto()  # type: ignore[attr-defined]
    config.inter_op_parallelism_threads = num_workers + 1
    for i in range(num_workers):
        tf.distribute.Server(spec, job_name="worker", task_index=i, config=config,  # type: ignore[attr-defined]
                             protocol="grpc")
    for i in range(num_ps):
        tf.distribute.Server(spec, job_name="ps", task_index=i, protocol="grpc")  # type: ignore[attr-defined]
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")  # type: ignore[attr-defined]


def tutorial_mlp(keras: Any) -> Any:
    """The tutorial's MLP on digits in tf-keras, compiled (call in the strategy's scope)."""
    model = keras.Sequential([keras.layers.Dense(64, activation="relu", input_shape=(64,)),
                              keras.layers.Dense(10)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def keras_fit_rate(strategy: Any, dataset_fn: Any, args: argparse.Namespace) -> dict:
    """tf-keras ``fit`` of the tutorial's MLP under TF's PS: closures (steps) per second, epoch times, accuracy."""
    import numpy as np
    import tf_keras as keras
    from tf_mwms_training import epoch_timer  # this folder is on sys.path when run

    with strategy.scope():
        model = tutorial_mlp(keras)
    creator = keras.utils.experimental.DatasetCreator(dataset_fn)
    model.fit(creator, epochs=1, steps_per_epoch=max(1, args.warmup), verbose=0)  # warm-up: traced, placed
    seconds: list[float] = []
    epochs = max(1, args.closures // args.steps_per_epoch)
    model.fit(creator, epochs=epochs, steps_per_epoch=args.steps_per_epoch, verbose=0,
              callbacks=[epoch_timer(keras, seconds)])
    return {"rate": epochs * args.steps_per_epoch / sum(seconds), "epoch_seconds": seconds,
            "accuracy": float(np.mean(np.argmax(model.predict(args.x, verbose=0), axis=1) == args.y))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--closures", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", choices=["softmax", "mlp"], default="softmax",
                        help="softmax: the hand-written closure; mlp: tf-keras fit of the tutorial's MLP")
    parser.add_argument("--steps-per-epoch", type=int, default=100, help="--model mlp: fit's steps_per_epoch")
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    x_all, y_all = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)
    strategy = tf.distribute.ParameterServerStrategy(_in_process_cluster(tf, args.workers, args.ps))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        kernel = tf.Variable(np.zeros((64, 10), np.float32), name="kernel")
        bias = tf.Variable(np.zeros(10, np.float32), name="bias")

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return (tf.data.Dataset.from_tensor_slices((x_all, y_all))
                .shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(args.batch).repeat())

    def per_worker_dataset_fn() -> object:  # TF's tutorial: the input context comes from the strategy
        return strategy.distribute_datasets_from_function(dataset_fn)

    if args.model == "mlp":
        args.x, args.y = x_all, y_all
        print(RESULT_MARKER + json.dumps(keras_fit_rate(strategy, dataset_fn, args)), flush=True)
        return
    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    @tf.function
    def train_step(it: object) -> None:
        x, y = next(it)  # type: ignore[call-overload]
        logits = tf.matmul(x, kernel) + bias
        p = tf.nn.softmax(logits) - tf.one_hot(y, 10)
        p = p / tf.cast(tf.shape(y)[0], tf.float32)
        kernel.assign_sub(0.1 * tf.matmul(x, p, transpose_a=True))
        bias.assign_sub(0.1 * tf.reduce_sum(p, axis=0))

    @tf.function
    def nothing() -> None:
        return None

    def rate(fn: object, with_iterator: bool) -> float:
        for _ in range(args.warmup):
            coordinator.schedule(fn, args=(iterator,) if with_iterator else ())
        coordinator.join()
        start = time.perf_counter()
        for _ in range(args.closures):
            coordinator.schedule(fn, args=(iterator,) if with_iterator else ())
        coordinator.join()
        return args.closures / (time.perf_counter() - start)

    result = {"rate": rate(train_step, True), "empty_rate": rate(nothing, False)}
    predictions = np.argmax(x_all @ kernel.numpy() + bias.numpy(), axis=1)
    result["accuracy"] = float(np.mean(predictions == y_all))
    print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
