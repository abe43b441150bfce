"""Train a PyTorch model data-parallel with daskdist's all-reduce (the PyTorch plug-in point).

Each replica trains its own copy of a small PyTorch MLP on its shard of the
digits; after every backward pass ``dd.plugins.torch.allreduce_gradients``
averages the gradients over the replicas (tensors go through DLPack), so all
copies take the same steps. The whole training loop runs inside the replicas:
one ``strategy.run`` call, no client round trip per step.

Needs PyTorch and scikit-learn: ``pip install -e ".[torch,examples]"`` in a
checkout (the ``torch`` extra pins the CPU build); ``make test`` installs
both, ``make run`` installs scikit-learn only.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

import daskdist as dd


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def train(dist, epochs: int, lr: float):
    """Runs on every replica: the training loop over this replica's shard."""
    import torch

    torch.set_num_threads(1)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    dd.plugins.torch.broadcast_parameters(model)
    for _ in range(epochs):
        for x, y in dist:
            if len(y) == 0:  # this replica ran out of data this step: join the all-reduce with zeros
                optimizer.zero_grad()
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            else:
                optimizer.zero_grad()
                loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            dd.plugins.torch.allreduce_gradients(model)
            optimizer.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def main(epochs: int) -> float:
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    split = int(0.8 * len(y))
    with dd.MirroredStrategy() as strategy:
        ds = dd.data.Dataset.from_tensor_slices((x[:split], y[:split])).shuffle(2000, seed=0).batch(
            32 * strategy.num_replicas_in_sync)
        dist = strategy.experimental_distribute_dataset(ds)
        weights = strategy.run(train, args=(dist, epochs, 0.1))  # a list of PerReplica, one per parameter
        for per_replica in weights:
            copies = strategy.experimental_local_results(per_replica)
            assert all(np.array_equal(copies[0], c) for c in copies), "replicas diverged"
        trained = [strategy.experimental_local_results(w)[0] for w in weights]
    model = make_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), trained):
            p.copy_(torch.from_numpy(w))
    accuracy = float((model(torch.from_numpy(x[split:])).argmax(1).numpy() == y[split:]).mean())
    print(f"{strategy.num_replicas_in_sync} replicas, test accuracy {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    logging.basicConfig(level=logging.WARNING)
    main(parser.parse_args().epochs)
