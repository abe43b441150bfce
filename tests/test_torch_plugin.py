"""Training a PyTorch module through daskdist's all-reduce (skipped without torch)."""

from __future__ import annotations

import platform

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


def _one_replica_fails(fail_rank):
    ctx = dd.get_replica_context()
    model = torch.nn.Linear(4, 2)
    dd.plugins.torch.broadcast_parameters(model)
    model(torch.ones(3, 4)).sum().backward()
    if ctx.replica_id_in_sync_group == fail_rank:
        raise ValueError("backward failed on this replica")
    dd.plugins.torch.allreduce_gradients(model, options=dd.CommunicationOptions(timeout_seconds=120))
    return 0


def test_a_replica_that_fails_before_the_allreduce_fails_the_run_without_a_hang(threaded_client):
    import time

    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        start = time.monotonic()
        with pytest.raises(ValueError, match="backward failed on this replica"):
            strategy.run(_one_replica_fails, args=(1,))
        assert time.monotonic() - start < 60  # the waiting replica is aborted, not left to its 120 s deadline
        assert strategy.run(_one_replica_fails, args=(-1,)) == 0  # the group still works (0 on both: TF's regroup)


def _mismatched_models():
    width = 2 + dd.get_replica_context().replica_id_in_sync_group
    model = torch.nn.Linear(4, width)
    model(torch.ones(3, 4)).sum().backward()
    dd.plugins.torch.allreduce_gradients(model)


def test_replicas_with_different_models_raise_a_mismatch(threaded_client):
    with (dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy,
          pytest.raises(dd.CollectiveMismatchError)):
        strategy.run(_mismatched_models)


def _page_faults_per_step(steps):
    threads = torch.get_num_threads()  # the session's shared workers get theirs back
    torch.set_num_threads(1)
    try:
        return _faults_on_one_thread(steps)
    finally:
        torch.set_num_threads(threads)


def _faults_on_one_thread(steps):
    import resource

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(32 * 13 * 13, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dd.plugins.torch.broadcast_parameters(model)
    x, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    faults = []
    for _ in range(steps):
        start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        dd.plugins.torch.allreduce_gradients(model)
        optimizer.step()
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start)
    return np.array(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_replica_keeps_its_step_memory(process_client):
    """With the plug-in's malloc options a step's tensors reuse memory: most steps fault no page in.

    Without them (``daskdist.replica.malloc: false``) every step of this loop faulted in about
    10,000 pages on the project's machine; with them the first steps grow the heap, then the median is 0
    (an occasional step still faults in one activation's pages). The options are the replicas'
    (``daskdist.replica.malloc``), set when the replicas start.
    """
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=process_client) as strategy:
        faults = strategy.experimental_local_results(strategy.run(_page_faults_per_step, args=(20,)))
    for per_step in faults:
        assert np.median(per_step[5:]) < 50, per_step
