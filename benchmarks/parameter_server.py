"""ParameterServerStrategy and CentralStorageStrategy figures (strategies.md section 6.1).

For each worker count N a fresh ``LocalCluster`` of single-threaded worker
processes (``num_ps`` + N) is started, and on it:

1. **Closure throughput.** The digits softmax classifier of
   ``examples/parameter_server.py`` (kernel 64x10 and bias on the ps, per-worker
   datasets, per-worker batch ``--batch``): after ``--warmup`` closures,
   ``--closures`` closures are scheduled and joined; committed closures per
   second T(N), and the scaling efficiency E(N) = T(N) / (N * T(1)). Also the
   requests each ps served per closure (1 with pull-ahead: one exchange per
   closure per ps). The same closures with the stores reached through Dask's
   comms instead of the direct channel (``daskdist.parameter-store.direct-channel``
   false): the A/B that decided the channel.
2. **Staleness** of every asynchronous update, as the store records it
   (version applied to minus version read): mean, p50, p99.
3. **Empty closures/s**: the coordinator's own ceiling (a closure that does
   nothing), and the schedule -> fetch latency of one closure (median).
4. **Bytes served per ps** for a 100,000 x 16 float32 embedding looked up
   by every closure (32 random rows), whole on one ps against
   ``MinSizePartitioner(max_shards=num_ps)``: KiB per closure of the busiest
   ps, and its max/mean over the ps.
5. **TensorFlow's own** ``ParameterServerStrategy`` + ``ClusterCoordinator``
   (``benchmarks/peers/tf_parameter_server.py``, in-process gRPC servers, in a
   subprocess) on the same model, data, batch and closure count: its
   closures/s, and the ratio daskdist / TF (goal >= 1.0).

Then, at ``--accuracy-workers`` workers (default: the largest N):
**time to a target test accuracy** (``--target``, digits held-out 20 %) of PS
asynchronous training against MirroredStrategy's synchronous custom loop
(``strategy.run`` per step, the same model, learning rate and per-replica
batch, MEAN-aggregated ``assign_sub``) on as many replicas. Training time
only (the accuracy checks every few steps are not counted).

And once, on 2 and 4 replicas: **CentralStorage against Mirrored** ``fit``
step time (median over epochs) on the tutorial's MLP at the same global
batch, and the optimizer memory held in the cluster (Adam: the replicas'
optimizer states, plus the store's for CentralStorage).

And per worker count N (the ``keras3`` part): **closures/s of a
Keras 3 model's** ``fit``: the tutorial's MLP (Dense(64, relu) - Dense(10),
Adam, sparse CE from logits, accuracy) in real Keras 3 on its torch backend,
built in ``dd.ParameterServerStrategy``'s scope, ``model.fit(DatasetCreator(
dataset_fn), steps_per_epoch=...)`` (each worker its own digits shard,
per-worker batch ``--batch``; one step per closure, the parameters and Adam's
slots on the ps) against the same model in tf-keras under TensorFlow's
``ParameterServerStrategy`` (its ``fit`` and ``ClusterCoordinator``; the peer's
``--model mlp``). One warm-up epoch each, then ``--rounds`` rounds alternated
(ABBA), the load average printed before each; closures/s = timed steps /
the epochs' wall time (``on_epoch_begin`` to ``on_epoch_end``), goal >= 1.0x TF.

Usage::

    .venv/bin/python benchmarks/parameter_server.py [--quick] [--workers 1 2 4] [--ps 2] [--closures 400]
    .venv/bin/python benchmarks/parameter_server.py --parts keras3 [--rounds 3]   # the Keras 3 figure only

``--quick``: N = 1 and 2, 100 closures, one timed epoch (a smoke run,
about a minute). Figures belong in BENCHMARKS.md only when measured on a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import dask
import numpy as np
from _common import alternating_rounds, format_table, local_cluster, percentile_ms, print_header

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers

TF_PEER = Path(__file__).resolve().parent / "peers" / "tf_parameter_server.py"
TF_MARKER = "@@ps-result "


class Roles:
    """The first ``num_ps`` Dask workers (by name) are ps, the rest workers."""

    def __init__(self, client: object, num_ps: int):
        self.client, self.num_ps = client, num_ps

    def cluster_spec(self) -> dict:
        info = scheduler_workers(self.client)  # asked now (the client's cached copy can read empty)
        ordered = sorted(info, key=lambda a: info[a]["name"])
        return {"ps": ordered[:self.num_ps], "worker": ordered[self.num_ps:]}


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)


def _softmax_step(kernel: object, bias: object, lr: float):
    """The closure's body: read kernel and bias, one softmax-regression gradient step on the batch."""

    def train_step(it: object) -> None:
        x, y = next(it)
        logits = x @ kernel.value() + bias.value()
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        p /= len(y)
        kernel.assign_sub(lr * (x.T @ p))
        bias.assign_sub(lr * p.sum(axis=0))

    return train_step


def closure_figures(client: object, num_ps: int, args: argparse.Namespace, only_rate: bool = False) -> dict:
    x_all, y_all = _digits()
    with dd.ParameterServerStrategy(Roles(client, num_ps), client=client) as strategy:
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            kernel = dd.Variable(np.zeros((64, 10), np.float32), name="kernel")
            bias = dd.Variable(np.zeros(10, np.float32), name="bias")
        iterator = iter(coordinator.create_per_worker_dataset(
            lambda ctx: dd.data.Dataset.from_tensor_slices((x_all, y_all)).shard(
                ctx.num_input_pipelines, ctx.input_pipeline_id).batch(args.batch).repeat()))
        train_step = _softmax_step(kernel, bias, 0.1)

        for _ in range(args.warmup):
            coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()
        stores = strategy.extended.stores
        before = [len(s.call_from_client(client, "staleness")) for s in stores]
        requests_before = [s.call_from_client(client, "requests") for s in stores]
        start = time.perf_counter()
        for _ in range(args.closures):
            coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()
        rate = args.closures / (time.perf_counter() - start)
        staleness = [v for s, b in zip(stores, before) for v in s.call_from_client(client, "staleness")[b:]]
        requests = [s.call_from_client(client, "requests") - b for s, b in zip(stores, requests_before)]
        if only_rate:
            return {"rate": rate}

        start = time.perf_counter()
        for _ in range(args.closures):
            coordinator.schedule(_nothing)
        coordinator.join()
        empty_rate = args.closures / (time.perf_counter() - start)
        latencies = []
        for _ in range(50):
            t0 = time.perf_counter()
            coordinator.schedule(_nothing).fetch()
            latencies.append(time.perf_counter() - t0)
    return {"rate": rate, "staleness": staleness, "empty_rate": empty_rate, "latency": latencies,
            "requests_per_closure": max(requests) / args.closures}


def _nothing() -> None:
    return None


def bytes_served(client: object, num_ps: int, partitioned: bool, closures: int) -> list[int]:
    partitioner = dd.experimental.partitioners.MinSizePartitioner(max_shards=num_ps) if partitioned else None
    with dd.ParameterServerStrategy(Roles(client, num_ps), variable_partitioner=partitioner,
                                    client=client) as strategy:
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            table = dd.Variable(np.zeros((100_000, 16), np.float32), name="embedding")
        rng = np.random.default_rng(0)
        for _ in range(closures):
            ids = rng.integers(0, 100_000, 32)
            coordinator.schedule(lambda i: dd.nn.embedding_lookup(table, i).sum(), args=(ids,))
        coordinator.join()
        return [s.call_from_client(client, "bytes_served") for s in strategy.extended.stores]


def tensorflow_peer(workers: int, args: argparse.Namespace, model: str = "softmax") -> dict | str:
    """TF's PS + ClusterCoordinator on the same closure, in a subprocess; its figures, or why it did not run."""
    command = [sys.executable, str(TF_PEER), "--workers", str(workers), "--ps", str(args.ps),
               "--closures", str(args.closures), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--model", model, "--steps-per-epoch", str(args.steps_per_epoch)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return "timed out"
    for line in done.stdout.splitlines():
        if line.startswith(TF_MARKER):
            return json.loads(line[len(TF_MARKER):])
    return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:] or ''}"


# -- time to accuracy ----------------------------------------------------------------------------


def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    x, y = _digits()
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def _accuracy(kernel: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(x @ kernel + bias, axis=1) == y))


def ps_time_to_accuracy(client: object, num_ps: int, args: argparse.Namespace) -> dict:
    """Asynchronous PS training until the held-out accuracy reaches ``args.target``: seconds, closures, samples."""
    x_train, y_train, x_test, y_test = _split()
    with dd.ParameterServerStrategy(Roles(client, num_ps), client=client) as strategy:
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        workers = len(strategy.extended.worker_addresses)
        with strategy.scope():
            kernel = dd.Variable(np.zeros((64, 10), np.float32), name="kernel")
            bias = dd.Variable(np.zeros(10, np.float32), name="bias")
        iterator = iter(coordinator.create_per_worker_dataset(
            lambda ctx: dd.data.Dataset.from_tensor_slices((x_train, y_train)).shard(
                ctx.num_input_pipelines, ctx.input_pipeline_id).shuffle(2000, seed=0).batch(args.batch).repeat()))
        step = _softmax_step(kernel, bias, args.lr)
        coordinator.schedule(_nothing).fetch()  # the workers are up
        trained, closures, accuracy = 0.0, 0, 0.0
        while closures < args.max_steps * workers:
            start = time.perf_counter()
            for _ in range(args.check_every * workers):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()
            trained += time.perf_counter() - start
            closures += args.check_every * workers
            accuracy = _accuracy(kernel.numpy(), bias.numpy(), x_test, y_test)
            if accuracy >= args.target:
                break
    return {"seconds": trained, "steps": closures, "samples": closures * args.batch, "accuracy": accuracy}


def mirrored_time_to_accuracy(replicas: int, args: argparse.Namespace) -> dict:
    """Synchronous MirroredStrategy custom loop on ``replicas`` replicas, the same model and per-replica batch."""
    x_train, y_train, x_test, y_test = _split()
    lr = args.lr
    with local_cluster(replicas) as client, dd.MirroredStrategy(client=client) as strategy:
        with strategy.scope():
            kernel = dd.Variable(np.zeros((64, 10), np.float32), name="kernel", aggregation=dd.VariableAggregation.MEAN)
            bias = dd.Variable(np.zeros(10, np.float32), name="bias", aggregation=dd.VariableAggregation.MEAN)
        dist = strategy.experimental_distribute_dataset(
            dd.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2000, seed=0).batch(
                args.batch * replicas).repeat())
        iterator = iter(dist)

        def step(batch: tuple) -> None:
            x, y = batch
            logits = x @ kernel.value() + bias.value()
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(y)), y] -= 1.0
            p /= max(len(y), 1)
            kernel.assign_sub(lr * (x.T @ p))  # MEAN over the replicas: the global batch's gradient
            bias.assign_sub(lr * p.sum(axis=0))

        strategy.run(step, args=(next(iterator),))  # warm-up step, counted
        trained, steps, accuracy = 0.0, 1, 0.0
        while steps < args.max_steps:
            start = time.perf_counter()
            for _ in range(args.check_every):
                strategy.run(step, args=(next(iterator),))
            trained += time.perf_counter() - start
            steps += args.check_every
            accuracy = _accuracy(kernel.numpy(), bias.numpy(), x_test, y_test)
            if accuracy >= args.target:
                break
    return {"seconds": trained, "steps": steps, "samples": steps * args.batch * replicas, "accuracy": accuracy}


# -- CentralStorage against Mirrored ---------------------------------------------------------------


def _replica_optimizer_bytes(service: object, model_id: str) -> int:
    """Bytes of a replica's own optimizer state for ``model_id`` (benchmark command)."""
    from daskdist.keras.runner import _replica_model

    state = _replica_model(service, model_id).optimizer.get_state()
    return int(sum(np.asarray(v).nbytes for v in state.values()))


def central_vs_mirrored(replicas: int, epochs: int) -> dict[str, dict[str, float]]:
    from daskdist import keras

    x, y = _digits()
    results = {}
    with local_cluster(replicas) as client:
        for name, make in (("mirrored", lambda: dd.MirroredStrategy(client=client)),
                           ("central-storage", lambda: dd.experimental.CentralStorageStrategy(client=client))):
            with make() as strategy:
                with strategy.scope():
                    model = keras.Sequential([keras.layers.Dense(64, activation="relu", input_shape=(64,)),
                                              keras.layers.Dense(10)])
                    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                  optimizer=keras.optimizers.Adam())
                data = dd.data.Dataset.from_tensor_slices((x, y)).batch(32 * replicas)
                model.fit(data, epochs=1, verbose=0)  # warm-up
                times = []
                for _ in range(epochs):
                    t0 = time.perf_counter()
                    model.fit(data, epochs=1, verbose=0)
                    times.append((time.perf_counter() - t0) / (len(y) // (32 * replicas) + 1))
                replica_bytes = sum(strategy.extended.run_on_replicas(_replica_optimizer_bytes, (model._model_id,)))
                held = 0
                if name == "central-storage":  # the optimizer runs at the store: its state lives there
                    held = int(sum(np.asarray(v).nbytes for v in model._optimizer_state().values()))
                results[name] = {"step": statistics.median(times), "optimizer_bytes": replica_bytes + held}
    return results


# -- a Keras 3 model under the PS strategy against tf-keras under TF's ------------------------------------------


def keras3_mlp():
    """The tutorial's MLP on digits in Keras 3, compiled as the TF peer's ``tutorial_mlp`` (call in a scope)."""
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


class Keras3Fit:
    """Keras 3 ``fit`` of the tutorial's MLP under ``dd.ParameterServerStrategy`` on an open cluster."""

    def __init__(self, client: object, num_ps: int, args: argparse.Namespace):
        import keras

        self.args = args
        self.strategy = dd.ParameterServerStrategy(Roles(client, num_ps), client=client)
        with self.strategy.scope():
            self.model = keras3_mlp()
        x_all, y_all = _digits()
        self.x, self.y = x_all, y_all
        batch = args.batch

        def dataset_fn(ctx: object) -> object:
            return dd.data.Dataset.from_tensor_slices((x_all, y_all)).shard(
                ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch).repeat()

        self.creator = dd.experimental.DatasetCreator(dataset_fn)
        self.timer_type = keras.callbacks.Callback
        self.model.fit(self.creator, epochs=1, steps_per_epoch=max(1, args.warmup), verbose=0)  # warm-up

    def rate(self) -> float:
        """One timed ``fit``: closures (steps) per second over its epochs."""
        seconds: list[float] = []

        class EpochTimer(self.timer_type):  # type: ignore[misc,name-defined]
            def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch: int, logs: object = None) -> None:
                seconds.append(time.perf_counter() - self.start)

        epochs = max(1, self.args.closures // self.args.steps_per_epoch)
        self.model.fit(self.creator, epochs=epochs, steps_per_epoch=self.args.steps_per_epoch, verbose=0,
                       callbacks=[EpochTimer()])
        return epochs * self.args.steps_per_epoch / sum(seconds)

    def accuracy(self) -> float:
        return float(np.mean(np.argmax(self.model.predict(self.x, verbose=0), axis=1) == self.y))

    def close(self) -> None:
        self.strategy.close()


def keras3_figures(args: argparse.Namespace) -> None:
    """Per N: Keras 3 ``fit`` closures/s under daskdist's PS against tf-keras ``fit`` under TF's, rounds alternated."""
    import keras
    import torch

    print(f"Keras {keras.__version__} backend {keras.backend.backend()}, torch {torch.__version__}; the tutorial's "
          f"MLP on digits, Adam, per-worker batch {args.batch}, {args.ps} ps, {args.closures} timed closures "
          f"per arm and round in epochs of {args.steps_per_epoch} steps, {args.rounds} rounds alternated\n",
          flush=True)
    rows = []
    for n in args.workers:
        with local_cluster(args.ps + n) as client:
            run = Keras3Fit(client, args.ps, args)

            def block(arm: str, run: Keras3Fit = run, n: int = n) -> float | str:
                if arm == "daskdist-keras3":
                    return round(run.rate(), 1)
                tf = tensorflow_peer(n, args, model="mlp")
                return round(tf["rate"], 1) if isinstance(tf, dict) else tf

            print(f"N = {n} workers:", flush=True)
            results = alternating_rounds(["daskdist-keras3", "tf-keras"], args.rounds, block, show_load=True)
            accuracy = run.accuracy()
            run.close()
        ours = [r for r in results["daskdist-keras3"] if isinstance(r, float)]
        theirs = [r for r in results["tf-keras"] if isinstance(r, float)]
        ratio = (f"{statistics.median(ours) / statistics.median(theirs):.2f}" if ours and theirs else "-")
        rows.append([n, f"{statistics.median(ours):.0f} ({min(ours):.0f}-{max(ours):.0f})" if ours else "-",
                     f"{statistics.median(theirs):.0f} ({min(theirs):.0f}-{max(theirs):.0f})" if theirs
                     else str(results["tf-keras"]), ratio, f"{accuracy:.3f}"])
    print(format_table(["workers", "Keras 3 (torch) under daskdist PS closures/s (median, range)",
                        "tf-keras under TF PS closures/s", "daskdist/TF", "daskdist model's accuracy (train)"],
                       rows))


# -- the run ---------------------------------------------------------------------------------------------


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: N = 1, 2; 100 closures; 1 epoch")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts N (default 1 2 4)")
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--closures", type=int, default=None, help="timed closures per N (default 400)")
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="per-worker (per-replica) batch")
    parser.add_argument("--epochs", type=int, default=None, help="timed fit epochs, CentralStorage vs Mirrored")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy for time to accuracy")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--check-every", type=int, default=10, help="steps per worker between accuracy checks")
    parser.add_argument("--max-steps", type=int, default=1000, help="steps per worker before giving up")
    parser.add_argument("--accuracy-workers", type=int, default=None, help="N for time to accuracy (default: max)")
    parser.add_argument("--no-tf", action="store_true", help="skip TensorFlow's PS peer")
    parser.add_argument("--parts", default="closures,accuracy,central,keras3",
                        help="comma-separated: closures (softmax closures, bytes, TF's PS), accuracy (time to "
                             "accuracy), central (CentralStorage vs Mirrored), keras3 (Keras 3 fit vs tf-keras)")
    parser.add_argument("--rounds", type=int, default=3, help="keras3: rounds alternated per N")
    parser.add_argument("--steps-per-epoch", type=int, default=100, help="keras3: fit's steps_per_epoch")
    args = parser.parse_args()
    args.workers = args.workers or ([1, 2] if args.quick else [1, 2, 4])
    args.closures = args.closures or (100 if args.quick else 400)
    args.warmup = min(args.warmup, 10) if args.quick else args.warmup
    args.epochs = args.epochs or (1 if args.quick else 5)
    args.accuracy_workers = args.accuracy_workers or max(args.workers)
    args.steps_per_epoch = min(args.steps_per_epoch, args.closures)
    args.rounds = 1 if args.quick else args.rounds
    args.parts = set(args.parts.split(","))
    return args


def main() -> None:
    args = _options()
    if "keras3" in args.parts:
        os.environ.setdefault("KERAS_BACKEND", "torch")  # before Keras is imported, here and in the workers
    print_header("ParameterServerStrategy: closures/s, staleness, bytes per ps, TF's PS; "
                 "time to accuracy; CentralStorage vs Mirrored; a Keras 3 model's fit vs tf-keras under TF's PS")
    if "closures" in args.parts:
        closure_table(args)
    if "accuracy" in args.parts:
        accuracy_table(args)
    if "central" in args.parts:
        central_table(args)
    if "keras3" in args.parts:
        keras3_figures(args)


def closure_table(args: argparse.Namespace) -> None:
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    rows, base = [], None
    for n in args.workers:
        with local_cluster(args.ps + n) as client:
            figures = closure_figures(client, args.ps, args)
            with dask.config.set({"daskdist.parameter-store.direct-channel": False}):
                through_dask = closure_figures(client, args.ps, args, only_rate=True)
            whole = bytes_served(client, args.ps, False, args.closures // 4)
            sharded = bytes_served(client, args.ps, True, args.closures // 4)
        tf_figures = "skipped" if args.no_tf else tensorflow_peer(n, args)
        base = base or figures["rate"] / n
        s = np.array(figures["staleness"] or [0])
        per_closure = max(1, args.closures // 4) * 1024
        tf_rate = f"{tf_figures['rate']:.0f}" if isinstance(tf_figures, dict) else str(tf_figures)
        ratio = f"{figures['rate'] / tf_figures['rate']:.2f}" if isinstance(tf_figures, dict) else "-"
        rows.append([n, f"{figures['rate']:.0f}", f"{figures['rate'] / (n * base):.2f}", f"{through_dask['rate']:.0f}",
                     f"{figures['requests_per_closure']:.2f}",
                     f"{s.mean():.2f}", f"{np.percentile(s, 50):.0f}", f"{np.percentile(s, 99):.0f}",
                     f"{figures['empty_rate']:.0f}", f"{percentile_ms(figures['latency'], 50):.2f}",
                     f"{max(whole) / per_closure:.1f} ({max(whole) / max(1, np.mean(whole)):.2f})",
                     f"{max(sharded) / per_closure:.1f} ({max(sharded) / max(1, np.mean(sharded)):.2f})",
                     tf_rate, ratio])
    print(format_table(["workers", "closures/s", "E(N)", "closures/s via Dask comms", "requests/closure/ps", "staleness mean", "p50", "p99",
                        "empty closures/s", "schedule->fetch ms", "KiB/closure busiest ps whole (max/mean)",
                        "sharded (max/mean)", "TF PS closures/s", "daskdist/TF"], rows))
    print()


def accuracy_table(args: argparse.Namespace) -> None:
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    n = args.accuracy_workers
    with local_cluster(args.ps + n) as client:
        ps = ps_time_to_accuracy(client, args.ps, args)
    mirrored = mirrored_time_to_accuracy(n, args)
    accuracy_rows = [[name, n, f"{r['seconds']:.2f}" + ("" if r["accuracy"] >= args.target else " (not reached)"),
                      r["steps"], r["samples"], f"{r['accuracy']:.3f}"]
                     for name, r in (("ParameterServer (async)", ps), ("Mirrored (sync)", mirrored))]
    print(f"Time to {args.target:.0%} held-out accuracy (digits softmax, lr {args.lr}, batch {args.batch} "
          "per worker/replica):")
    print(format_table(["strategy", "workers/replicas", "training s", "steps (closures)", "samples", "accuracy"],
                       accuracy_rows))
    print()


def central_table(args: argparse.Namespace) -> None:
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    css_rows = []
    for replicas in (2, 4):
        r = central_vs_mirrored(replicas, args.epochs)
        css_rows.append([replicas, f"{r['mirrored']['step'] * 1e3:.2f}", f"{r['central-storage']['step'] * 1e3:.2f}",
                         f"{r['central-storage']['step'] / r['mirrored']['step']:.2f}",
                         f"{r['mirrored']['optimizer_bytes'] / 1024:.0f}",
                         f"{r['central-storage']['optimizer_bytes'] / 1024:.0f}"])
    print(format_table(["replicas", "Mirrored step ms", "CentralStorage step ms", "ratio",
                        "Mirrored optimizer KiB (all replicas)", "CentralStorage optimizer KiB (store + replicas)"],
                       css_rows))


if __name__ == "__main__":
    main()
