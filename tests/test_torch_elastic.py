"""Elastic torch: a ``dd.elastic.State`` holding a ``TorchModel`` trains with stock DDP on the daskdist backend
and survives a kill -9 of a worker (and its nanny) mid-epoch.

The kill is placed at a step: the replica of rank 1 in the first generation stops inside its step,
either between forward and backward (the others wait in DDP's bucket all-reduce, which must raise
there, not crash them) or after its optimizer step (the others have applied that step too, which the
recovery must roll back: the restore of weights and SGD momentum is what keeps the result right), and
the test's ``Killer`` kills it there. The run finishes on the two survivors: the torch group is re-made
for the new generation, DDP re-wrapped, the newest commit restored, and the weights end within rtol
1e-5 of one process on the same global batches, every row committed once (the ledger) and trained once
(the row ids the replicas' steps return).

The commits are copied off the step path (a thread copies the parameters and optimizer state while the
next step runs; its ``optimizer.step()`` waits for the copy). On the survivor of rank 0 the copy of the
commit the run goes back to is held for two seconds (fault point ``state-copy``), across the killed
step: had that step's apply not waited for it, the commit would hold the step's update (the survivors'
copies would differ and the weights would take the step twice).
"""

from __future__ import annotations

import json
import os

import dask
import numpy as np
import pytest

import daskdist as dd
from tests.support.killers import Killer

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROWS, GLOBAL_BATCH, EPOCHS, KILL_STEP = 120, 12, 2, 4  # 10 steps per epoch; 12 rows split over 3 and over 2


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((ROWS, 8)), rng.integers(0, 3, ROWS)


def build():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    return module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def _reference():
    """One process over the same global batches in the same order: what every replica must end with."""
    module, optimizer = build()
    x, y = _data()
    for _ in range(EPOCHS):
        for start in range(0, ROWS, GLOBAL_BATCH):
            optimizer.zero_grad()
            rows = slice(start, start + GLOBAL_BATCH)
            torch.nn.functional.cross_entropy(module(torch.from_numpy(x[rows])), torch.from_numpy(y[rows])).backward()
            optimizer.step()
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def _pause_here(marker: str) -> None:
    """Stop this replica for the test's ``Killer`` (once: the first replica to get here)."""
    try:
        os.close(os.open(marker + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    partial = f"{marker}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid()}, f)
    os.replace(partial, marker)
    import time

    time.sleep(120)


def _import_torch():
    """Run on each worker before the elastic group exists: torch's first import holds the GIL for seconds,
    long enough under load for the scheduler's elastic heartbeat watch to declare the worker lost."""
    import importlib

    for name in ("torch", "torch.distributed", "torch.nn.parallel", "tests.test_torch_elastic",
                 "daskdist.plugins.torch.model", "daskdist.plugins.torch.backend"):
        importlib.import_module(name)


def step(model, batch, steps, where, marker):
    """One DDP step on this replica's part of the global batch; what the test checks of the group."""
    import torch.distributed as dist

    x, y, rows = batch
    ddp = model.ddp()  # the group and the wrapper of this generation
    here = steps == KILL_STEP and dist.get_rank() == 1 and dist.get_world_size() == 3
    model.optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp(torch.from_numpy(x)), torch.from_numpy(y))
    if here and where == "backward":
        _pause_here(marker)  # killed here; the others wait in backward's bucket all-reduce
    loss.backward()
    model.optimizer.step()
    if here and where == "apply":
        _pause_here(marker)  # killed here; the others applied this step, which the recovery rolls back
    return [dist.get_world_size(), dist.get_backend(), len(x), rows.tolist()]


@pytest.mark.parametrize("where", ["backward", "apply"])
def test_a_torch_ddp_loop_survives_a_kill_mid_epoch_with_the_uninterrupted_weights(process_workers, tmp_path,
                                                                                       where):
    workers = process_workers(3)
    workers.client.run(_import_torch)  # as a user's `dask worker --preload torch` does (docs/torch.md)
    x, y = _data()
    dataset = dd.data.Dataset.from_tensor_slices((x, y, np.arange(ROWS))).batch(GLOBAL_BATCH)
    marker = str(tmp_path / "paused.json")
    # a kill -9 is seen at once (the worker's connection closes); the heartbeat watch is for silent workers,
    # and torch's long GIL-holding calls on a machine under load 30-40 made it take live ones for lost
    settings = {"daskdist.elastic.heartbeat-timeout": "60s",
                # rank 0 copies the commit before the killed step for 2 s longer: the step's apply must wait
                "daskdist.testing.pause-at": f"state-copy:{KILL_STEP + 1}:0",
                "daskdist.testing.pause-file": str(tmp_path / "copy-held.json"),
                "daskdist.testing.pause-seconds": "2s"}
    seen = []
    with dask.config.set(settings), dd.MirroredStrategy(
            client=workers.client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
        model = dd.plugins.torch.TorchModel(strategy, build)
        victim = strategy.extended.worker_addresses[1]
        killer = Killer(tmp_path / "paused.json", workers=workers)

        @dd.elastic.run
        def train(state):
            while state.epoch < EPOCHS:
                for batch in state.batches(dataset):
                    out = strategy.run(step, args=(state.model, batch, state.steps, where, marker))
                    seen.append((state.epoch, state.batch, strategy.experimental_local_results(out)))
                    state.steps += 1
                    state.commit()
                state.epoch += 1

        state = dd.elastic.State(strategy, epoch=0, model=model, steps=0)
        train(state)
        record = killer.join()
        assert record["pid"] != os.getpid()
        (event,) = state.events
        assert event.lost == [victim] and len(event.members) == 2, event
        assert event.commit[1] == KILL_STEP + 1  # the newest commit all hold (1: the start's), then replayed
        assert not event.healed  # the survivors' copies of it agreed (none took the killed step's update)
        held = json.loads((tmp_path / "copy-held.json").read_text())  # the copy ran in its thread, held there
        assert (held["phase"], held["step"], held["rank"]) == ("state-copy", KILL_STEP + 1, 0)
        for epoch in range(EPOCHS):  # what the replicas trained in the steps that returned (each committed: the
            # kill's step never returned): every row once, none twice
            trained = [row for e, _, results in seen if e == epoch for r in results for row in r[3]]
            assert sorted(trained) == list(range(ROWS)), epoch
        assert state.steps == EPOCHS * ROWS // GLOBAL_BATCH and state.epoch == EPOCHS
        # every global batch trained once on the members of its time: 3 replicas of 4 rows, then 2 of 6
        sizes = [[r[0] for r in results] for _, _, results in seen]
        assert sizes[0] == [3, 3, 3] and sizes[-1] == [2, 2]
        assert all(r[1] == "daskdist" for _, _, results in seen for r in results)
        assert all(sum(r[2] for r in results) == GLOBAL_BATCH for _, _, results in seen)
        for epoch in range(EPOCHS):
            assert sorted(state.ledger.positions(epoch, state._rows).tolist()) == list(range(ROWS))
        expected = _reference()
        got = [model.state_dict(replica=r) for r in range(strategy.num_replicas_in_sync)]
        for name, want in expected.items():
            np.testing.assert_array_equal(got[0][name].numpy(), got[1][name].numpy())
            np.testing.assert_allclose(got[0][name].numpy(), want, rtol=1e-5, atol=1e-12)
