"""Keras 3 ``fit`` under ``dd.MirroredStrategy`` against plain Keras 3 and daskdist's built-in layers.

The tutorial's CNN (Conv2D(32, 3) - MaxPooling2D - Flatten - Dense(64) -
Dense(10)) on synthetic 28x28x1 data (MNIST-shaped; time to accuracy is not
measured on random labels), the same global batch everywhere:

* ``keras3-dd``: real Keras 3 (``--backend``: torch, or jax), created in
  ``dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"]).scope()`` on a 2-process
  local cluster, ``model.fit`` (each replica: Keras' forward and backward on
  half of every global batch, daskdist's all-reduce, Keras' optimizer.apply);
* ``keras3-plain``: the same Keras 3 model in this one process, torch with as
  many threads as the replicas have together (JAX: XLA's own threads, every
  core), what a user would otherwise run on the same cores;
* ``builtin-dd``: daskdist's built-in layers (``daskdist.keras``) under the
  same strategy on the same cluster.

One warm-up epoch each, then ``--rounds`` rounds, the order rotating per
round (``_common.alternating_rounds``), the load average printed before each
arm's epoch; samples/s per epoch. Then, on the replicas, the per-step cost of
daskdist over Keras' own step: ``fit``'s step time (from the epoch) against a
loop of Keras' ``model.train_step`` on the same per-replica batch with no
exchange (JAX: jitted, the state carried from step to step, as Keras' own
``fit`` runs it), and the gradient exchange alone (``SpmdStepDriver.exchange``).
``--backend jax`` runs the same arms with Keras' JAX backend (the replicas run
the step in two jitted halves around the exchange: ``backend_jax``); the
backend is chosen before Keras is imported, here and in the workers.
TensorFlow's MultiWorkerMirroredStrategy (tf-keras) is not run: TensorFlow is
not installed in the project's environment.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from _common import alternating_rounds, format_table, local_cluster, print_header  # noqa: E402

import daskdist as dd  # noqa: E402


def keras3_cnn():
    import keras

    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def builtin_cnn():
    from daskdist import keras as ddk

    model = ddk.Sequential([
        ddk.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
        ddk.layers.MaxPooling2D(),
        ddk.layers.Flatten(),
        ddk.layers.Dense(64, activation="relu"),
        ddk.layers.Dense(10),
    ])
    model.compile(loss=ddk.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=ddk.optimizers.Adam(), metrics=["accuracy"])
    return model


def _keras_step(model: object, x: np.ndarray, y: np.ndarray) -> tuple[object, str]:
    """Keras' own training step on one batch, as its ``fit`` runs it (no exchange), and the threads it uses."""
    import keras

    if keras.backend.backend() == "torch":
        import torch

        batch = (torch.from_numpy(x), torch.from_numpy(y))
        return (lambda: model.train_step(batch)), f"torch threads {torch.get_num_threads()}"
    import jax

    train = jax.jit(model.train_step, donate_argnums=0)  # as Keras' own JAX fit compiles it (the state donated)
    state = [tuple([jax.numpy.copy(v.value) for v in variables] for variables in (  # copies: donated below
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))]

    def step() -> None:  # the state carried from step to step, as Keras' JAX fit does
        _, state[0] = train(state[0], (x, y))
        jax.block_until_ready(state[0])

    return step, f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r}"


def _bare_steps(model_id: str, x: np.ndarray, y: np.ndarray, steps: int) -> dict:
    """On a replica: Keras' own train_step (no exchange) and the exchange alone, median seconds per step."""
    from daskdist import context
    from daskdist.plugins.keras3 import commands
    from daskdist.strategy.drivers.contract import SpmdStepDriver

    service = context.current_runtime()
    model = commands.trainable(service, model_id).model
    keras_step, threads = _keras_step(model, x, y)
    keras_step()  # JAX: compiled here
    bare, exchange = [], []
    driver = SpmdStepDriver()
    grads = [np.zeros(tuple(v.shape), np.float32) for v in model.trainable_variables]
    ctx = context.get_replica_context()
    flag = np.zeros(1, np.float32)
    for _ in range(steps):
        start = time.perf_counter()
        keras_step()
        bare.append(time.perf_counter() - start)
        ctx.all_reduce("sum", flag)  # both replicas start the exchange together: its time is not the other's step
        start = time.perf_counter()
        driver.exchange(grads, len(x))
        exchange.append(time.perf_counter() - start)
    return {"bare": statistics.median(bare), "exchange": statistics.median(exchange), "threads": threads}


def main(args: argparse.Namespace) -> None:
    os.environ["KERAS_BACKEND"] = args.backend  # before keras is imported (here, and in the workers they start)
    import keras

    from daskdist.plugins.keras3 import registry

    if args.backend == "torch":
        import torch

        framework = f"torch {torch.__version__}"
    else:
        import jax

        framework = f"jax {jax.__version__} ({jax.devices()[0].platform})"
    print_header("Keras 3 fit under dd.MirroredStrategy (2 replicas) vs plain Keras 3 vs the built-in layers")
    print(f"Keras {keras.__version__} backend {keras.backend.backend()}, {framework}; "
          f"global batch {args.batch}, {args.samples} samples per epoch, {args.rounds} rounds\n")
    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, args.samples).astype(np.int64)
    steps = args.samples // args.batch
    with local_cluster(2) as client:
        strategy = dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client)
        dataset = dd.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
        with strategy.scope():
            k3 = keras3_cnn()
            builtin = builtin_cnn()
        if args.backend == "torch":
            torch.set_num_threads(2)
        plain = keras3_cnn()

        runs = {
            "keras3-dd": lambda: k3.fit(dataset, epochs=1, verbose=0),
            "keras3-plain": lambda: plain.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0),
            "builtin-dd": lambda: builtin.fit(dataset, epochs=1, verbose=0),
        }
        for run in runs.values():  # warm-up: installs, first-touch allocations
            run()

        def samples_per_second(name: str) -> float:
            start = time.perf_counter()
            runs[name]()
            return round(args.samples / (time.perf_counter() - start), 1)

        results = alternating_rounds(list(runs), args.rounds, samples_per_second, show_load=True)

        record = registry.lookup(k3)
        half = args.batch // 2
        parts = strategy.experimental_local_results(strategy.run(
            _bare_steps, args=(record.object_id, x[:half], y[:half], max(steps, 10))))
        dd_step = args.batch / statistics.median(results["keras3-dd"])
        strategy.close()

    rows = [[name, f"{statistics.median(v):.0f}", f"{min(v):.0f}-{max(v):.0f}",
             f"{statistics.median(v) / statistics.median(results['keras3-plain']):.2f}"]
            for name, v in results.items()]
    print()
    print(format_table(["run", "samples/s (median)", "range", "vs keras3-plain"], rows))
    bare = statistics.mean(p["bare"] for p in parts)  # each replica's median, averaged over the replicas
    exchange = statistics.mean(p["exchange"] for p in parts)
    print(f"\nper step (2 replicas, {half} rows each, {parts[0]['threads']} per replica): "
          f"fit {dd_step * 1e3:.2f} ms, Keras' own train_step {bare * 1e3:.2f} ms, "
          f"exchange (all-reduce of {sum(int(np.prod(v.shape)) for v in k3.trainable_variables) * 4 / 1e6:.2f} MB) "
          f"{exchange * 1e3:.2f} ms; daskdist over Keras' step: {(dd_step - bare) * 1e3:.2f} ms "
          f"(of which exchange {exchange * 1e3:.2f} ms, the rest {(dd_step - bare - exchange) * 1e3:.2f} ms)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128, help="global batch (64 per replica, as the tutorial)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=["torch", "jax"], default=os.environ.get("KERAS_BACKEND", "torch"),
                        help="Keras' backend (default: $KERAS_BACKEND, else torch)")
    main(parser.parse_args())
