"""Asynchronous parameter-server training on daskdist (TF's parameter-server training tutorial, in small).

A local Dask cluster: the first ``--ps`` workers hold the parameters, the
others train. The softmax classifier's kernel is split over the ps by a
partitioner (a ``ShardedVariable``); each worker reads its own shard of the
digits data through a per-worker dataset; ``coordinator.schedule`` queues one
closure per step, and whichever worker is free runs it: it pulls the
parameters, computes the gradient of its batch and pushes the update to the
ps, where it is applied. Workers never wait for each other.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import numpy as np
from distributed import Client, LocalCluster

import daskdist as dd


class WorkerRoles:
    """A cluster resolver for a local cluster: the first ``num_ps`` Dask workers (by name) are ps."""

    def __init__(self, client: Client, num_ps: int):
        self.client, self.num_ps = client, num_ps

    def cluster_spec(self) -> dict:
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        ordered = sorted(info, key=lambda a: info[a]["name"])
        return {"ps": ordered[:self.num_ps], "worker": ordered[self.num_ps:]}


def load_digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def main(args: argparse.Namespace) -> float:
    (x_train, y_train), (x_test, y_test) = load_digits()
    with LocalCluster(n_workers=args.ps + args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=":0", silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        strategy = dd.ParameterServerStrategy(
            WorkerRoles(client, args.ps),
            variable_partitioner=dd.experimental.partitioners.FixedShardsPartitioner(num_shards=args.ps),
            client=client)
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            kernel = dd.Variable(np.zeros((64, 10), np.float32), name="kernel")  # sharded over the ps
            bias = dd.Variable(np.zeros(10, np.float32), name="bias")
        print(f"ps: {strategy.extended.ps_addresses}\nworkers: {list(strategy.extended.worker_addresses)}")
        print(f"kernel shards: {[v.shape for v in kernel.variables]} on {[v.device for v in kernel.variables]}")

        def dataset_fn(ctx):
            return (dd.data.Dataset.from_tensor_slices((x_train, y_train))
                    .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
                    .shuffle(2000, seed=ctx.input_pipeline_id).batch(args.batch).repeat())

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        def train_step(it):
            x, y = next(it)
            logits = x @ kernel.value() + bias.value()
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            loss = float(-np.log(p[np.arange(len(y)), y] + 1e-9).mean())
            p[np.arange(len(y)), y] -= 1.0
            p /= len(y)
            kernel.assign_sub(args.lr * (x.T @ p))
            bias.assign_sub(args.lr * p.sum(axis=0))
            return loss

        start = time.perf_counter()
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        seconds = time.perf_counter() - start
        fetched = coordinator.fetch(losses)
        for step in range(0, args.steps, max(1, args.steps // 8)):
            print(f"step {step:4d}: loss {np.mean(fetched[step:step + 20]):.4f}")
        predictions = (x_test @ kernel.numpy() + bias.numpy()).argmax(axis=1)
        accuracy = float((predictions == y_test).mean())
        print(f"{args.steps} closures in {seconds:.2f} s ({args.steps / seconds:.0f}/s); test accuracy {accuracy:.4f}")
        strategy.close()
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--target", type=float, default=0.95, help="fail (exit 1) below this test accuracy")
    arguments = parser.parse_args()
    result = main(arguments)
    if result < arguments.target:
        print(f"FAILED: test accuracy {result:.4f} is below the target {arguments.target}")
        sys.exit(1)
    print(f"OK: test accuracy {result:.4f} (target {arguments.target})")
