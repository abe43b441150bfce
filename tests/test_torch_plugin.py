"""Training a PyTorch module through daskdist's all-reduce (skipped without torch)."""

from __future__ import annotations

import numpy as np
import pytest

import daskdist as dd

torch = pytest.importorskip("torch")


def _train(dist, steps_wanted):
    torch.manual_seed(dd.get_replica_context().replica_id_in_sync_group)  # different initial weights...
    model = torch.nn.Linear(4, 2)
    dd.plugins.torch.broadcast_parameters(model)  # ...made equal by the broadcast
    start = [p.detach().numpy().copy() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x, y in dist:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y), reduction="sum").backward()
        dd.plugins.torch.allreduce_gradients(model, op="SUM")
        grads.append(model.weight.grad.numpy().copy())
        optimizer.step()
    return np.stack(grads), model.weight.detach().numpy().copy(), start


def test_gradients_are_summed_over_replicas_and_copies_stay_equal(threaded_client):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        dist = strategy.experimental_distribute_dataset(dd.data.Dataset.from_tensor_slices((x, y)).batch(64))
        grads, weights, start = strategy.run(_train, args=(dist, 1))
        g0, g1 = strategy.experimental_local_results(grads)
        w0, w1 = strategy.experimental_local_results(weights)
        start_weight, start_bias = (strategy.experimental_local_results(s)[0] for s in start)
    np.testing.assert_array_equal(g0, g1)
    np.testing.assert_array_equal(w0, w1)
    # the summed gradient equals one device's gradient over the whole batch, from the same start
    reference = torch.nn.Linear(4, 2)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(start_weight))
        reference.bias.copy_(torch.from_numpy(start_bias))
    torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y), reduction="sum").backward()
    np.testing.assert_allclose(g0[0], reference.weight.grad.numpy(), rtol=1e-5, atol=1e-5)
