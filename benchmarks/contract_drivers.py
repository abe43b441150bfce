"""The built-in layers' ``fit`` through each step driver: steps/s under ParameterServer, CentralStorage, Mirrored.

One training contract: the built-in model trains through
the strategy's step driver (``SpmdStepDriver``, ``HolderStepDriver``,
``PsStepDriver``). This script times what a user runs, ``model.fit``, on the
digits MLP of ``tests/test_ps_keras_fit.py`` (64 -> 32 -> 10, Adam), on a
fresh ``LocalCluster`` of single-threaded worker processes per strategy:

* ``ps``: ParameterServerStrategy, 2 ps + 2 workers, ``steps_per_execution``
  5, ``--steps`` steps per epoch: closures/s and steps/s of the timed epochs;
* ``central``: CentralStorageStrategy on 2 replicas, steps/s;
* ``mirrored``: MirroredStrategy on 2 replicas, steps/s.

One warm-up epoch, then ``--epochs`` timed epochs (median epoch time). The
code measured is whatever ``daskdist`` imports: run it with ``PYTHONPATH``
set to each tree to compare two trees in one sitting::

    PYTHONPATH=<tree> .venv/bin/python benchmarks/contract_drivers.py [--only ps central mirrored]

Prints the load average before each strategy (figures under load say so).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import numpy as np


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)


def _model(keras: object, steps_per_execution: int = 1) -> object:
    model = keras.Sequential([keras.layers.Dense(32, activation="relu", input_shape=(64,)),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


def _timed_fit(model: object, fit_kwargs: dict, epochs: int) -> list[float]:
    from daskdist import keras

    class Timer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            self.times.append(time.perf_counter() - self.start)

    timer = Timer()
    model.fit(epochs=epochs + 1, verbose=0, callbacks=[timer], **fit_kwargs)
    return timer.times[1:]


def run(which: str, args: argparse.Namespace) -> str:
    from distributed import Client, LocalCluster

    import daskdist as dd
    from daskdist import keras

    x, y = _digits()
    with LocalCluster(n_workers=4 if which == "ps" else 2, threads_per_worker=1, processes=True,
                      dashboard_address=":0", silence_logs=logging.ERROR) as cluster, \
            Client(cluster, set_as_default=False) as client:
        if which == "ps":
            resolver = dd.cluster_resolver.DaskClusterResolver(client, num_ps=2)
            with dd.ParameterServerStrategy(resolver) as strategy:
                with strategy.scope():
                    model = _model(keras, steps_per_execution=5)

                def dataset_fn(ctx: object) -> object:
                    return (dd.data.Dataset.from_tensor_slices((x, y))
                            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                            .shuffle(1000, seed=0).batch(32).repeat())

                times = _timed_fit(model, {"x": dd.experimental.DatasetCreator(dataset_fn),
                                           "steps_per_epoch": args.steps}, args.epochs)
            epoch = statistics.median(times)
            return f"ps: {args.steps / 5 / epoch:.1f} closures/s, {args.steps / epoch:.1f} steps/s"
        strategy = (dd.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"], client=client) if which == "central"
                    else dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client))
        with strategy:
            with strategy.scope():
                model = _model(keras)
            data = dd.data.Dataset.from_tensor_slices((x, y)).batch(64)
            times = _timed_fit(model, {"x": data}, args.epochs)
            steps = -(-len(x) // 64)
        return f"{which}: {steps / statistics.median(times):.1f} steps/s (global batch 64)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=["ps", "central", "mirrored"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch under ParameterServerStrategy")
    args = parser.parse_args()
    import daskdist

    print(f"daskdist from {os.path.dirname(daskdist.__file__)}")
    for which in args.only:
        print(f"load average {os.getloadavg()}", flush=True)
        print(run(which, args), flush=True)


if __name__ == "__main__":
    main()
