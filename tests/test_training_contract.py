"""The training contract on its own: a framework-neutral numpy Trainable under each Extended's step driver.

Real Dask workers (threads of this process); the same global batches through
the SPMD driver (Mirrored), the parameter holder's (CentralStorage) and the
parameter servers' (ParameterServerStrategy, closures run one at a time) give
the weights one process computes, and the holder and the ps keep the update
rule's slots, not the replicas.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd
from daskdist import context
from daskdist.group.service import MODEL
from daskdist.strategy.drivers.contract import (
    HeldTrainable,
    ParameterHoldingDriver,
    SpmdStepDriver,
    StepDriver,
    Trainable,
)
from daskdist.strategy.drivers.held import HolderStepDriver, PsStepDriver

TWO = ["/cpu:0", "/cpu:1"]
#: 2 replicas split a global batch of 8 rows 4/4; 3 replicas 3/3/2, where only weighting by rows is right
DEVICES = {2: TWO, 3: ["/cpu:0", "/cpu:1", "/cpu:2"]}
FEATURES = 5
STEPS = 6
GLOBAL_BATCH = 8


class Momentum:
    """An update rule: heavy-ball momentum, its slots ``v/<index>`` and ``iterations`` in its state."""

    def __init__(self, learning_rate: float = 0.05, beta: float = 0.9):
        self.learning_rate = learning_rate
        self.beta = beta
        self.slots: dict[int, np.ndarray] = {}
        self.iterations = 0

    def apply(self, params, grads):
        for i, (param, grad) in enumerate(zip(params, grads)):
            velocity = self.slots.setdefault(i, np.zeros_like(param))
            velocity *= self.beta
            velocity += grad
            param -= self.learning_rate * velocity
        self.iterations += 1

    def get_state(self):
        return {"iterations": np.array(self.iterations), **{f"v/{i}": v.copy() for i, v in self.slots.items()}}

    def set_state(self, state):
        self.iterations = int(state["iterations"])
        self.slots = {int(k.split("/")[1]): np.array(v) for k, v in state.items() if k.startswith("v/")}


class LinearTrainable:
    """Least squares ``x @ w + b``: a trainable in plain numpy (no framework), the contract's smallest adapter."""

    def __init__(self):
        self.w = np.zeros((FEATURES, 1))
        self.b = np.zeros(1)
        self.rule = Momentum()

    def parameters(self):
        return [self.w, self.b]

    def gradients(self, x, y):
        error = x @ self.w + self.b - y
        return [2 * x.T @ error / len(x), 2 * error.sum(0) / len(x)], float((error ** 2).sum())

    def train_step(self, batch, exchange):
        x, y = batch
        grads, loss_sum = self.gradients(x, y)
        reduced = exchange(grads, len(x), sums=(loss_sum,))
        if reduced is not None:
            self.rule.apply(self.parameters(), reduced)

    def join_step(self, exchange):
        reduced = exchange([np.zeros_like(p) for p in self.parameters()], 0, sums=(0.0,))
        if reduced is not None:
            self.rule.apply(self.parameters(), reduced)

    def assign(self, values):
        for target, value in zip(self.parameters(), values):
            if value is not None:
                np.copyto(target, value)

    def update_rule(self):
        return self.rule

    def snapshot(self):
        return {"params": [p.copy() for p in self.parameters()], "rule": self.rule.get_state()}

    def restore(self, state):
        self.assign(state["params"])
        self.rule.set_state(state["rule"])


class SpmdOnly:
    """A trainable with no ``assign``/``update_rule``: the SPMD driver trains it, the holder refuses it."""

    def __init__(self):
        self.inner = LinearTrainable()

    def parameters(self):
        return self.inner.parameters()

    def train_step(self, batch, exchange):
        self.inner.train_step(batch, exchange)

    def join_step(self, exchange):
        self.inner.join_step(exchange)

    def snapshot(self):
        return self.inner.snapshot()

    def restore(self, state):
        self.inner.restore(state)


def _global_batches():
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(FEATURES, 1))
    batches = []
    for _ in range(STEPS):
        x = rng.normal(size=(GLOBAL_BATCH, FEATURES))
        batches.append((x, x @ true_w + 0.5))
    return batches


def _reference(batches):
    """The same steps in one process: the global batch's mean gradient, the rule applied once per step."""
    model = LinearTrainable()
    losses = []
    for x, y in batches:
        grads, loss_sum = model.gradients(x, y)
        model.rule.apply(model.parameters(), grads)
        losses.append(loss_sum)
    return model, losses


def _per_replica(batches, replicas):
    """Replica r's share of every global batch (the last replica of a 3-way split of 8 rows gets 2)."""
    return [[(x[r::replicas], y[r::replicas]) for x, y in batches] for r in range(replicas)]


def _train_on_replica(service, key, shares, driver, factory):
    trainable = service.objects.find(MODEL, key)
    if trainable is None:
        trainable = factory()
        service.objects.install(MODEL, key, trainable)
    driver.begin(trainable)
    totals = [driver.step(trainable, batch, len(batch[0])) for batch in shares[service.rank]]
    return [p.copy() for p in trainable.parameters()], [(t.rows, t.sums) for t in totals], \
        trainable.update_rule().iterations if hasattr(trainable, "update_rule") else None


def test_the_trainables_satisfy_the_protocols():
    assert isinstance(LinearTrainable(), HeldTrainable) and isinstance(LinearTrainable(), Trainable)
    assert isinstance(SpmdOnly(), Trainable) and not isinstance(SpmdOnly(), HeldTrainable)
    assert isinstance(SpmdStepDriver(), StepDriver) and not isinstance(SpmdStepDriver(), ParameterHoldingDriver)


def test_the_spmd_driver_alone_is_one_process_training():
    batches = _global_batches()
    reference, losses = _reference(batches)
    model, driver = LinearTrainable(), SpmdStepDriver()
    driver.begin(model)
    totals = [driver.step(model, batch, len(batch[0])) for batch in batches]
    for a, b in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    assert [t.rows for t in totals] == [GLOBAL_BATCH] * STEPS
    np.testing.assert_allclose([t.sums[0] for t in totals], losses)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicas", [2, 3])
def test_spmd_driver_applies_the_global_gradient_everywhere(threaded_client, replicas):
    batches = _global_batches()
    reference, losses = _reference(batches)
    with dd.MirroredStrategy(devices=DEVICES[replicas], client=threaded_client) as strategy:
        driver = strategy.extended.step_driver()
        assert isinstance(driver, SpmdStepDriver)
        results = strategy.extended.run_on_replicas(
            _train_on_replica, ("linear", _per_replica(batches, replicas), driver, LinearTrainable))
    assert len(results) == replicas
    for params, totals, iterations in results:
        for a, b in zip(params, reference.parameters()):
            np.testing.assert_allclose(a, b, rtol=1e-10)
        assert [rows for rows, _ in totals] == [GLOBAL_BATCH] * STEPS  # global rows
        np.testing.assert_allclose([sums[0] for _, sums in totals], losses)  # global loss sums, in the same message
        assert iterations == STEPS  # every replica applied every step


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicas", [2, 3])
def test_holder_driver_reduces_to_the_store_applies_once_and_every_replica_assigns(threaded_client, replicas):
    batches = _global_batches()
    reference, losses = _reference(batches)
    with dd.experimental.CentralStorageStrategy(DEVICES[replicas], client=threaded_client) as strategy:
        driver = strategy.extended.step_driver("linear")
        assert isinstance(driver, HolderStepDriver) and isinstance(driver, ParameterHoldingDriver)
        assert driver.stored_state(threaded_client, 2) is None  # nothing held before the first step
        results = strategy.extended.run_on_replicas(
            _train_on_replica, ("linear", _per_replica(batches, replicas), driver, LinearTrainable))
        assert len(results) == replicas
        for params, totals, iterations in results:
            for a, b in zip(params, reference.parameters()):
                np.testing.assert_allclose(a, b, rtol=1e-10)
            assert [rows for rows, _ in totals] == [GLOBAL_BATCH] * STEPS
            np.testing.assert_allclose([sums[0] for _, sums in totals], losses)
            assert iterations == 0  # the replicas' own rules never ran: one rule, at the holder
        stored = driver.stored_state(threaded_client, 2)
        assert int(stored["rule_state"]["iterations"]) == STEPS
        np.testing.assert_allclose(stored["rule_state"]["v/0"], reference.rule.slots[0], rtol=1e-10)
        for a, b in zip(stored["params"], reference.parameters()):
            np.testing.assert_allclose(a, b, rtol=1e-10)
        # the client overwrites the held copy (set_weights, load_weights); the next step starts from it
        assert driver.set_stored(threaded_client, 2, params=[np.ones((FEATURES, 1)), np.zeros(1)])
        np.testing.assert_array_equal(driver.stored_state(threaded_client, 2)["params"][0], np.ones((FEATURES, 1)))


@pytest.mark.timeout(120)
def test_holder_driver_refuses_a_trainable_without_assign_on_every_replica(threaded_client):
    with dd.experimental.CentralStorageStrategy(TWO, client=threaded_client) as strategy:
        driver = strategy.extended.step_driver()
        with pytest.raises(TypeError, match="HeldTrainable"):
            strategy.extended.run_on_replicas(
                _train_on_replica, ("spmd-only", _per_replica(_global_batches(), 2), driver, SpmdOnly))
        # the strategy is still usable: the SPMD-only trainable trains under Mirrored, the holder trains a held one
        batches = _global_batches()[:1]
        results = strategy.extended.run_on_replicas(
            _train_on_replica, ("linear", _per_replica(batches, 2), driver, LinearTrainable))
        reference, _ = _reference(batches)
        assert len(results) == 2
        for params, _, _ in results:
            for a, b in zip(params, reference.parameters()):
                np.testing.assert_allclose(a, b, rtol=1e-10)


class _WorkerCopy:
    """What a parameter-server worker keeps: its trainable and the driver that remembers its pulls."""

    def __init__(self, trainable, driver):
        self.trainable = trainable
        self.driver = driver

    def snapshot(self):
        return self.trainable.snapshot()

    def restore(self, state):
        self.trainable.restore(state)


def _install_copy(service, key, copy):
    service.objects.install(MODEL, key, copy)


def _closure(key, batch):
    worker = context.current_runtime().objects.get(MODEL, key)
    worker.driver.begin(worker.trainable)
    totals = worker.driver.step(worker.trainable, batch, len(batch[0]))
    return totals.rows, totals.sums, worker.trainable.rule.iterations


@pytest.mark.timeout(180)
def test_ps_driver_pulls_computes_and_pushes_each_closure(threaded_client):
    batches = _global_batches()
    reference, losses = _reference(batches)
    resolver = dd.cluster_resolver.DaskClusterResolver(threaded_client, num_ps=1)  # 1 ps, 2 workers
    with dd.ParameterServerStrategy(resolver) as strategy:
        driver = strategy.extended.step_driver("linear")
        assert isinstance(driver, PsStepDriver) and isinstance(driver, ParameterHoldingDriver)
        coordinator = dd.experimental.coordinator.ClusterCoordinator(strategy)
        coordinator.run_on_each_worker(_install_copy, lambda _i: ("linear", _WorkerCopy(LinearTrainable(), driver)))
        results = []
        for batch in batches:  # one closure at a time: each pulls what the previous one (on any worker) pushed
            results.append(coordinator.schedule(_closure, args=("linear", batch)).fetch())
        assert [rows for rows, _, _ in results] == [GLOBAL_BATCH] * STEPS
        np.testing.assert_allclose([sums[0] for _, sums, _ in results], losses)
        assert all(iterations == 0 for _, _, iterations in results)  # the workers' rules never ran
        stored = driver.stored_state(threaded_client, 2)
        assert int(stored["rule_state"]["iterations"]) == STEPS
        for a, b in zip(stored["params"], reference.parameters()):
            np.testing.assert_allclose(a, b, rtol=1e-10)
