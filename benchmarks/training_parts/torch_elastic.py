"""``benchmarks/elastic.py --model torch``: what a ``dd.elastic.State`` commit of a ``TorchModel`` costs a step.

The tutorial's CNN in PyTorch (``torch_parts.make_model``, Adam), stock DDP on the ``daskdist`` backend
through ``TorchModel.ddp()``, in a custom loop (the torch path has no ``fit``).

* ``commit``: 2 replicas (a ``LocalCluster``), epochs alternating (ABBA) between a plain strategy's loop
  (``strategy.run`` per global batch) and elastic loops (``state.batches``, ``state.commit()`` every step or
  every 10, the commit copied off the step path; and every step copied at once, before the reply, as every
  commit was before: ``AtOnceModel``, whose replicas do not guard the copy). Each epoch's first step is left
  out of its time (it re-wraps DDP for that strategy's group: the arms share the workers' torch default group).
* ``snapshot``: in this process, no cluster: the replica's step alone, followed by a commit copied at once
  (``TorchReplicaModel.snapshot``), followed by a commit copied off the step path (``Commit.copying``; the
  next step's ``optimizer.step()`` waits for it), and followed by a copy of the step's gradients (what a
  replayed commit would have to keep per step in torch, see docs/torch.md); for the CNN and for a wider MLP
  (784-2048-2048-10, 8.3 M parameters: a copy that is no longer small against the step).
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from typing import Any

from training_parts import torch_parts

BATCH = 64


def build() -> Any:
    """On each replica: the CNN and Adam, one thread (one replica's share of the cores)."""
    import torch

    torch.set_num_threads(1)
    module = torch_parts.make_model()
    return module, torch.optim.Adam(module.parameters(), lr=torch_parts.LR)


def build_wide() -> Any:
    """A wider model: an MLP 784-2048-2048-10 and Adam (the snapshot part's second model)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 2048), torch.nn.ReLU(),
                                 torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    return module, torch.optim.Adam(module.parameters(), lr=torch_parts.LR)


def _at_once_model(dd: Any, strategy: Any) -> Any:
    """A ``TorchModel`` whose replicas' commits are copied at once, before the reply (as before the off-path
    copy): its resident has no ``guard_copy``, so ``commit_now`` snapshots it there."""
    from daskdist.plugins.torch.model import TorchReplicaModel

    class AtOnceReplicaModel(TorchReplicaModel):
        guard_copy = None  # type: ignore[assignment]

    class AtOnceModel(dd.plugins.torch.TorchModel):  # type: ignore[misc]
        def resident(self) -> Any:
            return AtOnceReplicaModel(self._build)

    return AtOnceModel(strategy, build)


def step(model: Any, batch: Any) -> None:
    """One DDP step on the replica's share of the global batch."""
    import torch

    x, y = batch
    ddp = model.ddp()
    model.optimizer.zero_grad()
    torch.nn.functional.cross_entropy(ddp(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    model.optimizer.step()


def _import_torch() -> None:
    import torch.distributed  # noqa: F401  (before the groups start: a long import under load misses heartbeats)

    import daskdist.plugins.torch.model  # noqa: F401


def commit_cost(epochs: int, steps: int, format_table: Any, local_cluster: Any) -> None:
    import daskdist as dd

    x, y = torch_parts.synthetic_nchw(steps * BATCH)
    dataset = dd.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    arms = {"plain": None, "commit every step": 1, "commit every step, copied at once": 1, "commit every 10": 10}
    times: dict[str, list[float]] = {name: [] for name in arms}
    with local_cluster(2) as client:
        client.run(_import_torch)
        runners = {}
        for name, every in arms.items():
            elastic = None if every is None else dd.ElasticOptions(min_replicas=1)
            strategy = dd.MirroredStrategy(client=client, elastic=elastic)
            if "at once" in name:
                model = _at_once_model(dd, strategy)
            else:
                model = dd.plugins.torch.TorchModel(strategy, build)
            runners[name] = _plain(strategy, model, dataset) if every is None else _elastic(
                dd, strategy, model, dataset, every)
        for runner in runners.values():  # warm-up
            runner()
        order = list(arms)
        for epoch in range(epochs):
            print(f"round {epoch + 1}: load before {os.getloadavg()[0]:.2f}", flush=True)
            for name in (order if epoch % 2 == 0 else order[::-1]):
                times[name].append(runners[name]() / (steps - 1))
    plain = statistics.median(times["plain"])
    rows = [[name, f"{statistics.median(t) * 1e3:.2f}", f"{statistics.median(t) / plain:.3f}",
             f"{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}"] for name, t in times.items()]
    print(format_table(["loop", "ms per step (median)", "ratio to plain", "range (ms)"], rows), flush=True)


def _plain(strategy: Any, model: Any, dataset: Any) -> Any:
    def epoch() -> float:
        start = 0.0
        for i, batch in enumerate(strategy.experimental_distribute_dataset(dataset)):
            strategy.run(step, args=(model, batch))
            if i == 0:
                start = time.perf_counter()
        return time.perf_counter() - start

    return epoch


def _elastic(dd: Any, strategy: Any, model: Any, dataset: Any, every: int) -> Any:
    state = dd.elastic.State(strategy, epoch=0, model=model)

    @dd.elastic.run
    def train(state: Any) -> float:
        start = 0.0
        for batch in state.batches(dataset):
            strategy.run(step, args=(state.model, batch))
            if state.batch % every == 0:
                state.commit()
            if state.batch == 1:
                start = time.perf_counter()
        state.epoch += 1
        return time.perf_counter() - start

    return lambda: train(state)


def snapshot_cost(steps: int, time_arms: Any, arms_table: Any) -> None:
    """``time_arms``/``arms_table``: the benchmarks' ``alternating_arm_times`` and ``arm_times_table``."""
    for name, make in (("the CNN", build), ("the wide MLP", build_wide)):
        print(f"\n{name}:")
        _snapshot_cost(make, steps, time_arms, arms_table)


def _snapshot_cost(make: Any, steps: int, time_arms: Any, arms_table: Any) -> None:
    import torch

    from daskdist.elastic.replica import Commit
    from daskdist.group.service import MODEL, ResidentStore
    from daskdist.plugins.torch.model import TorchReplicaModel

    resident = pickle.loads(pickle.dumps(TorchReplicaModel(make)))
    store = ResidentStore()
    store.install(MODEL, "m", resident)
    x, y = (torch.from_numpy(a[:BATCH // 2]) for a in torch_parts.synthetic_nchw(BATCH // 2))

    def plain() -> None:
        resident.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(resident.module(x), y).backward()
        resident.optimizer.step()

    def off_path() -> None:
        plain()
        commit = Commit.copying((1, 1, 0), store, {})
        if not resident.guard_copy(commit.settle):  # as commit_now: the first commits are waited for at once
            commit.settle()

    arms = {
        "plain step": plain,
        "plain step (again: the noise)": plain,
        "step + commit copied at once (before)": lambda: (plain(), resident.snapshot()),
        "step + commit copied off the step path": off_path,
        "step + its gradients copied (a replayed commit's keep)": lambda: (
            plain(), [p.grad.clone() for p in resident.module.parameters()]),
    }
    plain()
    times = time_arms(arms, steps, after=resident.settle_copies)  # the last copy's wait counts for its arm
    state = resident.snapshot()
    nbytes = sum(t.nbytes for t in state.module.values())
    nbytes += sum(t.nbytes for slots in state.optimizer["state"].values() for t in slots.values())
    print(f"load before: {os.getloadavg()[0]:.2f}; torch {torch.__version__}; {steps} alternations of 4 steps; "
          f"a full copy is {nbytes:,} bytes (weights + Adam's slots)")
    print(arms_table(times))
