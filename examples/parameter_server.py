"""Asynchronous parameter-server training on daskdist (TF's parameter-server training tutorial, in small).

A local Dask cluster: ``DaskClusterResolver(client, num_ps=--ps)`` makes
``--ps`` workers hold the parameters, the others train. The data is a Dask
DataFrame (the digits, 64 pixel columns and a label) persisted on the
training workers; each worker's per-worker dataset reads the partitions its
own Dask worker holds (``shard`` by locality), and the coordinator's data
ledger shows which partitions the committed closures read. The model is a softmax classifier over a large hashed
embedding: every (position, pixel value) pair is a token,
hashed into ``--rows`` rows (default 2**18, 10 floats each: 10 MB), split over
the ps by ``MinSizePartitioner`` into a ``ShardedVariable``. A closure reads
only the rows its batch touches (``dd.nn.embedding_lookup``) and pushes only
their gradient (``scatter_sub`` of an ``IndexedSlices``), which the ps apply;
workers never wait for each other.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import dask.dataframe as ddf
import numpy as np
import pandas as pd
from distributed import Client, LocalCluster

import daskdist as dd


def load_digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def tokens(pixels: np.ndarray, rows: int) -> np.ndarray:
    """Hashed ids of (position, value) for each pixel of each image: shape (images, 64)."""
    values = np.rint(pixels * 16).astype(np.int64)
    raw = np.arange(values.shape[1]) * 17 + values
    return (raw * 2654435761) % rows


def main(args: argparse.Namespace) -> float:
    (x_train, y_train), (x_test, y_test) = load_digits()
    with LocalCluster(n_workers=args.ps + args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=":0", silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        resolver = dd.cluster_resolver.DaskClusterResolver(client, num_ps=args.ps)
        workers = resolver.cluster_spec().as_dict()["worker"]
        frame = pd.DataFrame(x_train, columns=[f"p{i}" for i in range(64)]).assign(label=y_train)
        train = client.persist(ddf.from_pandas(frame, npartitions=8), workers=workers)  # on the training workers

        strategy = dd.ParameterServerStrategy(
            resolver,
            variable_partitioner=dd.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=256 << 10, max_shards=args.ps),
            client=client)
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            embedding = dd.Variable(np.zeros((args.rows, 10), np.float32), name="embedding")  # sharded
            bias = dd.Variable(np.zeros(10, np.float32), name="bias")
        print(f"ps: {strategy.extended.ps_addresses}\nworkers: {list(strategy.extended.worker_addresses)}")
        print(f"embedding shards: {[v.shape for v in embedding.variables]} on "
              f"{[v.device for v in embedding.variables]}")

        def dataset_fn(ctx):
            return (dd.data.Dataset.from_dask(train).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).cache()
                    .shuffle(2000, seed=ctx.input_pipeline_id).batch(args.batch).repeat())

        per_worker = coordinator.create_per_worker_dataset(dataset_fn)
        print(f"partitions read by each worker (where they are held): {per_worker.locality.partitions}")
        iterator = iter(per_worker)
        rows = args.rows

        def train_step(it):
            batch = next(it)
            x = np.stack([batch[f"p{i}"] for i in range(64)], axis=1).astype(np.float32)
            y = np.asarray(batch["label"], np.int64)
            ids = tokens(x, rows)                                           # (batch, 64)
            logits = dd.nn.embedding_lookup(embedding, ids).sum(axis=1) + bias.value()   # pulls touched rows
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            loss = float(-np.log(p[np.arange(len(y)), y] + 1e-9).mean())
            p[np.arange(len(y)), y] -= 1.0
            p /= len(y)
            grads = np.repeat(p[:, None, :], ids.shape[1], axis=1).reshape(-1, 10)  # d loss / d row, per token
            embedding.scatter_sub(dd.IndexedSlices(values=args.lr * grads, indices=ids.reshape(-1)))
            bias.assign_sub(args.lr * p.sum(axis=0))
            return loss

        start = time.perf_counter()
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        seconds = time.perf_counter() - start
        fetched = coordinator.fetch(losses)
        for step in range(0, args.steps, max(1, args.steps // 8)):
            print(f"step {step:4d}: loss {np.mean(fetched[step:step + 20]):.4f}")
        logits = dd.nn.embedding_lookup(embedding, tokens(x_test, rows)).sum(axis=1) + bias.numpy()
        accuracy = float((logits.argmax(axis=1) == y_test).mean())
        read = coordinator.data_ledger.partitions()
        print(f"data ledger, first pass: {len(read)} partitions read, {coordinator.data_ledger.rows()} rows, "
              f"duplicates: {coordinator.data_ledger.duplicates() or 'none'}")
        print(f"{args.steps} closures in {seconds:.2f} s ({args.steps / seconds:.0f}/s); test accuracy {accuracy:.4f}")
        strategy.close()
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--rows", type=int, default=1 << 18, help="rows of the hashed embedding")
    parser.add_argument("--target", type=float, default=0.93, help="fail (exit 1) below this test accuracy")
    arguments = parser.parse_args()
    result = main(arguments)
    if result < arguments.target:
        print(f"FAILED: test accuracy {result:.4f} is below the target {arguments.target}")
        sys.exit(1)
    print(f"OK: test accuracy {result:.4f} (target {arguments.target})")
