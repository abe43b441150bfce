"""ParameterServerStrategy and CentralStorageStrategy figures (issue 14, strategies.md section 6.1).

For each worker count N a fresh ``LocalCluster`` of single-threaded worker
processes (``num_ps`` + N) is started, and on it:

1. **Closure throughput.** The digits softmax classifier of
   ``examples/parameter_server.py`` (kernel 64x10 and bias on the ps, per-worker
   datasets, per-worker batch ``--batch``): after ``--warmup`` closures,
   ``--closures`` closures are scheduled and joined; committed closures per
   second T(N), and the scaling efficiency E(N) = T(N) / (N * T(1)).
2. **Staleness** of every asynchronous update, as the store records it
   (version applied to minus version read): mean, p50, p99. Homogeneous
   workers give a mean of about N - 1.
3. **Empty closures/s**: the coordinator's own ceiling (a closure that does
   nothing), and the schedule -> fetch latency of one closure (median).
4. **Bytes served per ps** for a 100,000 x 16 float32 embedding looked up
   by every closure (32 random rows), whole on one ps against
   ``MinSizePartitioner(max_shards=num_ps)``: max/mean over the ps.

And once, on 2 and 4 replicas: **CentralStorage against Mirrored** ``fit``
step time (median over epochs) on the tutorial's MLP at the same global batch.

Usage::

    .venv/bin/python benchmarks/parameter_server.py [--workers 1 2 4] [--ps 2] [--closures 400]

Figures belong in BENCHMARKS.md only when measured on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import format_table, local_cluster, percentile_ms, print_header

import daskdist as dd


class Roles:
    """The first ``num_ps`` Dask workers (by name) are ps, the rest workers."""

    def __init__(self, client: object, num_ps: int):
        self.client, self.num_ps = client, num_ps

    def cluster_spec(self) -> dict:
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        ordered = sorted(info, key=lambda a: info[a]["name"])
        return {"ps": ordered[:self.num_ps], "worker": ordered[self.num_ps:]}


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)


def closure_figures(client: object, num_ps: int, args: argparse.Namespace) -> dict:
    x_all, y_all = _digits()
    with dd.ParameterServerStrategy(Roles(client, num_ps), client=client) as strategy:
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            kernel = dd.Variable(np.zeros((64, 10), np.float32), name="kernel")
            bias = dd.Variable(np.zeros(10, np.float32), name="bias")
        iterator = iter(coordinator.create_per_worker_dataset(
            lambda ctx: dd.data.Dataset.from_tensor_slices((x_all, y_all)).shard(
                ctx.num_input_pipelines, ctx.input_pipeline_id).batch(args.batch).repeat()))

        def train_step(it):
            x, y = next(it)
            logits = x @ kernel.value() + bias.value()
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(y)), y] -= 1.0
            p /= len(y)
            kernel.assign_sub(0.1 * (x.T @ p))
            bias.assign_sub(0.1 * p.sum(axis=0))

        for _ in range(args.warmup):
            coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()
        stores = strategy.extended._stores
        before = [len(s.call_from_client(client, "staleness")) for s in stores]
        start = time.perf_counter()
        for _ in range(args.closures):
            coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()
        rate = args.closures / (time.perf_counter() - start)
        staleness = [v for s, b in zip(stores, before) for v in s.call_from_client(client, "staleness")[b:]]

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
    return {"rate": rate, "staleness": staleness, "empty_rate": empty_rate, "latency": latencies}


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
        return [s.call_from_client(client, "bytes_served") for s in strategy.extended._stores]


def central_vs_mirrored(replicas: int, epochs: int) -> dict[str, float]:
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
                results[name] = statistics.median(times)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--closures", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    print_header("ParameterServerStrategy: closures/s, staleness, bytes per ps; CentralStorage vs Mirrored")
    rows, base = [], None
    for n in args.workers:
        with local_cluster(args.ps + n) as client:
            figures = closure_figures(client, args.ps, args)
            whole = bytes_served(client, args.ps, False, args.closures // 4)
            sharded = bytes_served(client, args.ps, True, args.closures // 4)
        base = base or figures["rate"] / n
        s = np.array(figures["staleness"] or [0])
        rows.append([n, f"{figures['rate']:.0f}", f"{figures['rate'] / (n * base):.2f}",
                     f"{s.mean():.2f}", f"{np.percentile(s, 50):.0f}", f"{np.percentile(s, 99):.0f}",
                     f"{figures['empty_rate']:.0f}", f"{percentile_ms(figures['latency'], 50):.2f}",
                     f"{max(whole) / max(1, np.mean(whole)):.2f}", f"{max(sharded) / max(1, np.mean(sharded)):.2f}"])
    print(format_table(["workers", "closures/s", "E(N)", "staleness mean", "p50", "p99", "empty closures/s",
                        "schedule->fetch ms", "bytes max/mean whole", "bytes max/mean sharded"], rows))
    print()
    css_rows = []
    for replicas in (2, 4):
        times = central_vs_mirrored(replicas, args.epochs)
        css_rows.append([replicas, f"{times['mirrored'] * 1e3:.2f}", f"{times['central-storage'] * 1e3:.2f}",
                         f"{times['central-storage'] / times['mirrored']:.2f}"])
    print(format_table(["replicas", "Mirrored step ms", "CentralStorage step ms", "ratio"], css_rows))


if __name__ == "__main__":
    main()
