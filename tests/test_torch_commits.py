"""A ``TorchModel``'s elastic commit copied off the step path, on one replica's resident (no cluster needed).

The commit's copy is held in its thread (``before_copy``) while the next step runs: the step's forward and
backward go on, its ``optimizer.step()`` waits for the copy, and the commit holds the state before that step
(parameters, the optimizer's state, the buffers and random state the forward changed). Commits go off the
step path only once a step after a commit changed the weights only in ``optimizer.step()``; a loop that
writes them outside it keeps its commits copied at once; a weight changed in place outside
``optimizer.step()`` while an off-path copy runs is a clear error, not a wrong commit. The same commit path
under a kill with real workers: ``tests/test_torch_elastic.py``.
"""

from __future__ import annotations

import logging
import pickle
import time

import pytest

from daskdist.elastic.replica import Commit
from daskdist.group.service import MODEL, ResidentStore

torch = pytest.importorskip("torch")

from daskdist.plugins.torch import model as torch_model  # noqa: E402 (needs torch)
from daskdist.plugins.torch.model import TorchReplicaModel  # noqa: E402 (needs torch)

KEY = (MODEL, "m")


def build():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5),
                                 torch.nn.Linear(16, 3)).double()
    return module, torch.optim.Adam(module.parameters(), lr=0.01)


def _replica(make=build):
    """The resident as a replica holds it (built where it is unpickled), in a store of its own."""
    resident = pickle.loads(pickle.dumps(TorchReplicaModel(make)))
    store = ResidentStore()
    store.install(MODEL, "m", resident)
    return resident, store


def _step(resident, seed):
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 8, generator=generator).double(), torch.randint(0, 3, (6,), generator=generator)
    resident.optimizer.zero_grad()
    torch.nn.functional.cross_entropy(resident.module(x), y).backward()
    resident.optimizer.step()


def _commit_at_once(store, resident):
    """A commit as ``commit_now`` takes it while the resident does not guard its copy: waited for at once."""
    commit = Commit.copying((1, 0, 0), store, {})
    assert resident.guard_copy(commit.settle) is False
    commit.settle()
    return commit


def _off_the_path(store, resident):
    """The first commit is copied at once; a step after it that changed the weights only in optimizer.step()
    lets the next ones go off the step path."""
    _commit_at_once(store, resident)
    _step(resident, 0)


def _held_commit(store, resident, seconds, started=None):
    """A commit whose copy waits ``seconds`` in its thread first, guarded by the resident; ``started`` (a list)
    gets the monotonic time the wait began."""

    def hold():
        if started is not None:
            started.append(time.monotonic())
        time.sleep(seconds)

    commit = Commit.copying((1, 1, 0), store, {}, hold)
    assert resident.guard_copy(commit.settle)
    return commit


def _states_equal(a, b):
    for name in a.module:
        torch.testing.assert_close(a.module[name], b.module[name], rtol=0, atol=0)
    for index, slots in a.optimizer["state"].items():
        for slot, value in slots.items():
            torch.testing.assert_close(value, b.optimizer["state"][index][slot], rtol=0, atol=0)
    assert a.optimizer["param_groups"] == b.optimizer["param_groups"]
    assert torch.equal(a.rng, b.rng)


def test_a_commit_copied_during_the_next_step_holds_the_state_before_it():
    resident, store = _replica()
    _off_the_path(store, resident)
    _step(resident, 1)
    before = resident.snapshot()  # at once, on this thread: what the commit must hold
    started: list[float] = []
    commit = _held_commit(store, resident, 0.5, started)
    _step(resident, 2)  # forward (buffers, dropout's draws) and backward run beside the copy; the apply waits
    assert started and time.monotonic() - started[0] >= 0.5  # the step ended after the copy did
    after_step = resident.snapshot()
    _states_equal(commit.state[KEY], before)
    # gone back to, the commit runs the step again to the same bits (the random state is the commit's)
    resident.restore(commit.state[KEY])
    _step(resident, 2)
    _states_equal(resident.snapshot(), after_step)


def test_a_weight_written_in_place_while_a_commit_copies_is_a_clear_error_at_the_next_apply():
    resident, store = _replica()
    _off_the_path(store, resident)
    weight = next(resident.module.parameters())
    kept = weight.detach().clone()
    _held_commit(store, resident, 0.3)
    with torch.no_grad():
        weight.mul_(2.0)  # outside optimizer.step(): the copy may read either value
    with pytest.raises(RuntimeError, match=r"changed in place outside optimizer\.step\(\) while an elastic commit"):
        _step(resident, 2)
    torch.testing.assert_close(weight.detach(), kept * 2.0, rtol=0, atol=0)  # the failed step applied nothing


def test_a_loop_that_writes_weights_outside_the_optimizer_step_keeps_its_commits_at_once(caplog, monkeypatch):
    # the warning is read from the module's logger, whatever an earlier test's logging set-up did to it (a
    # dictConfig disables the loggers that exist; a level set above WARNING hides it)
    monkeypatch.setattr(torch_model.logger, "disabled", False)
    monkeypatch.setattr(torch_model.logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger=torch_model.logger.name)
    resident, store = _replica()
    weight = next(resident.module.parameters())
    for seed in (1, 2, 3):  # never off the step path: each commit's copy is waited for at the commit
        _commit_at_once(store, resident)
        with torch.no_grad():
            weight.clamp_(-0.1, 0.1)  # a constraint applied before the step, after the commit
        _step(resident, seed)
        assert "copied at once from now on" in caplog.text
    _commit_at_once(store, resident)
    _step(resident, 4)  # a step that writes nothing outside optimizer.step() no longer changes that
    _commit_at_once(store, resident)


def module_only():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_a_model_without_an_optimizer_is_copied_at_the_commit():
    resident, _ = _replica(module_only)
    assert resident.guard_copy(lambda: None) is False  # no step to wait in: commit_now copies at once
