"""Stock PyTorch DistributedDataParallel on a Dask cluster: daskdist as the torch.distributed backend.

The seed tutorial's CNN (conv 3x3x32, max-pool, dense 64, dense 10) in plain
PyTorch, wrapped in torch's own ``DistributedDataParallel``. The input lives
on the cluster as Dask arrays and reaches each replica through
``strategy.experimental_distribute_dataset``; ``strategy.run`` launches the
training function on every replica, where ``dd.plugins.torch.init_process_group()``
makes ``"daskdist"`` torch's default backend (rank = replica id, world size =
replicas in sync, no ``MASTER_ADDR``, no port). DDP's bucketed all-reduces
then travel over daskdist's transports.

torch's default group is per process, so the cluster runs one worker process
per replica (``LocalCluster(processes=True, threads_per_worker=1)``).

Data: the handwritten digits that scikit-learn ships (8x8 images).
Needs PyTorch (CPU build: ``pip install torch==2.13.0``) and scikit-learn.
"""

from __future__ import annotations

import argparse
import logging

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import daskdist as dd


def make_model():
    """The tutorial's CNN, for 8x8 single-channel images."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(32 * 3 * 3, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    )


def train(dist_dataset, epochs: int, lr: float):
    """Runs on every replica: plain PyTorch with stock DDP over this replica's shard."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # one core per replica: torch's intra-op pool must not oversubscribe it
    dd.plugins.torch.init_process_group()
    model = DistributedDataParallel(make_model())  # broadcasts rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    for _ in range(epochs):
        total, steps = 0.0, 0
        for x, y in dist_dataset:  # this replica's part of each global batch
            optimizer.zero_grad()
            loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()  # DDP all-reduces the gradients in buckets here
            optimizer.step()
            total, steps = total + float(loss), steps + 1
        mean = torch.tensor([total / max(steps, 1)])
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(float(mean))
    weights = [p.detach().numpy().copy() for p in model.module.parameters()]
    dist.destroy_process_group()
    return weights, losses


def main(replicas: int, epochs: int, batch_per_replica: int = 32) -> float:
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # NCHW
    y = digits.target.astype(np.int64)
    split = int(0.8 * len(y))
    with LocalCluster(n_workers=replicas, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client, dd.MirroredStrategy(client=client) as strategy:
        print(f"Number of devices: {strategy.num_replicas_in_sync}")
        train_x = client.persist(da.from_array(x[:split], chunks=(256, 1, 8, 8)))
        train_y = client.persist(da.from_array(y[:split], chunks=256))
        global_batch = batch_per_replica * strategy.num_replicas_in_sync
        dataset = dd.data.Dataset.from_dask((train_x, train_y)).shuffle(2048, seed=0).batch(
            global_batch, drop_remainder=True)
        dist_dataset = strategy.experimental_distribute_dataset(dataset)
        weights, losses = strategy.run(train, args=(dist_dataset, epochs, 0.05))
        copies = [strategy.experimental_local_results(w) for w in weights]
        assert all(np.array_equal(c[0], other) for c in copies for other in c), "replicas diverged"
        history = strategy.experimental_local_results(losses)[0]
    model = make_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), copies):
            p.copy_(torch.from_numpy(w[0]))
    accuracy = float((model(torch.from_numpy(x[split:])).argmax(1).numpy() == y[split:]).mean())
    print("loss per epoch: " + ", ".join(f"{v:.4f}" for v in history))
    print(f"{replicas} replicas, test accuracy {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    logging.basicConfig(level=logging.WARNING)
    args = parser.parse_args()
    main(args.replicas, args.epochs)
