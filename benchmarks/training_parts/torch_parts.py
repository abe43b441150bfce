"""Part 3 of the training benchmark: one small PyTorch CNN trained data-parallel two ways.

* daskdist: ``dd_train`` runs inside every replica (one ``strategy.run``): the
  loop of ``examples/pytorch_plugin.py`` over the replica's shard of a
  distributed dataset, with ``dd.plugins.torch.allreduce_gradients`` after each
  backward pass.
* DDP: ``ddp_rank`` is one ``torch.multiprocessing.spawn`` rank:
  ``DistributedDataParallel`` over gloo (``tcp://127.0.0.1:<port>``), the same
  model, optimizer, batches and steps over the rank's contiguous block of the
  same synthetic data.

Both set ``torch.set_num_threads(1)`` and glibc's ``malloc`` options of
``dd.plugins.torch.set_malloc_options`` (the replicas set them when they start,
``daskdist.replica.malloc``), and time each epoch the same way: a barrier, then the epoch's
steps; an epoch's time is the slowest rank's. The first epoch is a warm-up and
is not reported. Each epoch also records the training thread's user and system
CPU time and minor page faults, which show an allocator that hands memory back
every step.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

SHAPE = (1, 28, 28)  # NCHW
CLASSES = 10
LR = 1e-3


def synthetic_nchw(samples: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-shaped float32 images in [0, 1) (NCHW) and int64 labels: the same arrays in every process."""
    rng = np.random.default_rng(seed)
    images = (rng.integers(0, 256, (samples, *SHAPE), dtype=np.uint8) / np.float32(255.0)).astype(np.float32)
    labels = rng.integers(0, CLASSES, samples).astype(np.int64)
    return images, labels


def make_model() -> Any:
    """The tutorial's CNN in PyTorch: conv 3x3x32 + ReLU, max-pool 2, flatten, dense 64 + ReLU, dense 10."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(32 * 13 * 13, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES),
    )


#: Per-epoch figures, in this order, in the arrays and JSON both systems return.
FIELDS = ("seconds", "steps", "input", "allreduce", "user", "sys", "minflt")


def thread_usage() -> tuple[float, float, int]:
    """This thread's CPU seconds (user, system) and minor page faults so far (``RUSAGE_THREAD``, Linux)."""
    r = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return r.ru_utime, r.ru_stime, r.ru_minflt


def timed_epochs(epochs: int, batches: Callable[[], Iterable[Any]], step: Callable[[Any, Any], float],
                 barrier: Callable[[], None]) -> list[dict]:
    """Run ``epochs`` passes; per pass the ``FIELDS``.

    seconds, steps, seconds waiting for input, seconds in ``step``'s
    all-reduce, and the training thread's user and system CPU seconds and
    minor page faults (system time and faults show an allocator that maps and
    unmaps memory every step).
    """
    out = []
    for _ in range(epochs):
        barrier()
        usage = thread_usage()
        start = time.perf_counter()
        wait = reduce = 0.0
        n = 0
        iterator = iter(batches())
        while True:
            t = time.perf_counter()
            try:
                x, y = next(iterator)
            except StopIteration:
                wait += time.perf_counter() - t
                break
            wait += time.perf_counter() - t
            reduce += step(x, y)
            n += 1
        seconds = time.perf_counter() - start
        user, sys_, minflt = (b - a for a, b in zip(usage, thread_usage()))
        out.append({"seconds": seconds, "steps": n, "input": wait, "allreduce": reduce, "user": user, "sys": sys_,
                    "minflt": minflt})
    return out


def dd_train(dist: Any, epochs: int) -> np.ndarray:
    """On a replica: ``epochs`` passes of the plug-in loop over this replica's shard of ``dist``.

    Returns ``(epochs, len(FIELDS))``: the ``FIELDS`` of each pass.
    """
    import torch

    import daskdist as dd

    torch.set_num_threads(1)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    dd.plugins.torch.broadcast_parameters(model)
    ctx = dd.get_replica_context()

    def step(x: Any, y: Any) -> float:
        optimizer.zero_grad()
        if len(y) == 0:  # this replica ran out of data this step: join the all-reduce with zeros
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        t = time.perf_counter()
        dd.plugins.torch.allreduce_gradients(model)
        seconds = time.perf_counter() - t
        optimizer.step()
        return seconds

    barrier = ctx.barrier if ctx.num_replicas_in_sync > 1 else (lambda: None)
    result = timed_epochs(epochs, lambda: dist, step, barrier)
    return np.array([[r[f] for f in FIELDS] for r in result])


def ddp_rank(rank: int, world: int, port: int, samples: int, batch: int, epochs: int, out_dir: str) -> None:
    """One DDP rank (``torch.multiprocessing.spawn`` target); writes its epoch times to ``out_dir/rank-N.json``."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel

    import daskdist as dd

    torch.set_num_threads(1)
    dd.plugins.torch.set_malloc_options()  # what the replicas set when they start (module docstring)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        images, labels = synthetic_nchw(samples)
        per_rank = samples // world
        x = torch.from_numpy(images[rank * per_rank:(rank + 1) * per_rank])
        y = torch.from_numpy(labels[rank * per_rank:(rank + 1) * per_rank])
        model = DistributedDataParallel(make_model())
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        loss_fn = torch.nn.CrossEntropyLoss()

        def batches() -> Iterable[Any]:
            for start in range(0, per_rank - batch + 1, batch):
                yield x[start:start + batch], y[start:start + batch]

        def step(xb: Any, yb: Any) -> float:
            optimizer.zero_grad()
            loss_fn(model(xb), yb).backward()  # DDP all-reduces gradient buckets during backward
            optimizer.step()
            return 0.0

        result = timed_epochs(epochs, batches, step, tdist.barrier)
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "epochs": result, "torch": torch.__version__}, f)
    finally:
        tdist.destroy_process_group()
