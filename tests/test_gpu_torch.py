"""PyTorch and Keras 3 on CUDA (``make gpu-check`` runs these): skipped without a CUDA build of torch and a GPU.

One replica per GPU worker of dask-cuda's ``LocalCUDACluster`` (the embedded
cluster on a GPU machine): DDP over CUDA tensors, whose collectives the
``daskdist`` backend forwards to torch's ``ProcessGroupNCCL`` met through the
``DaskdistStore`` rendezvous (the Dask scheduler, no port); ``SyncBatchNorm``
on CUDA; a Keras 3 model (torch backend) fitted on the GPU. With one GPU
the group has one replica: the rendezvous, the forwarding and the CUDA
kernels still run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("dask_cuda")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device here (a CPU build of torch, or no GPU)", allow_module_level=True)

import daskdist as dd  # noqa: E402

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count()
STEPS, GLOBAL_BATCH = 3, 16


@pytest.fixture(scope="module")
def gpu_strategy():
    with dd.MirroredStrategy(devices=[f"/gpu:{i}" for i in range(GPUS)]) as strategy:
        yield strategy


def _model(batch_norm: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(32))
    layers += [torch.nn.ReLU(), torch.nn.Linear(32, 3)]
    return torch.nn.Sequential(*layers)


def _batch(step: int):
    rng = np.random.default_rng(step)
    return (torch.from_numpy(rng.standard_normal((GLOBAL_BATCH, 8)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 3, GLOBAL_BATCH)))


def _ddp_on_cuda(batch_norm: bool):
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(0)  # dask-cuda shows each worker its own GPU as device 0
    dd.plugins.torch.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(batch_norm)
    if batch_norm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = DistributedDataParallel(model.cuda(), device_ids=[0])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    local = GLOBAL_BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        mine = slice(rank * local, (rank + 1) * local)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[mine].cuda()), y[mine].cuda()).backward()
        optimizer.step()
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    return [p.detach().cpu().numpy() for p in model.parameters()], t.cpu().tolist()


def _reference(batch_norm: bool):
    model = _model(batch_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().numpy() for p in model.parameters()]


@pytest.mark.parametrize("batch_norm", [False, True], ids=["ddp", "syncbn"])
def test_gpu_ddp_on_cuda_tensors_through_the_store_rendezvous(gpu_strategy, batch_norm):
    results = gpu_strategy.experimental_local_results(gpu_strategy.run(_ddp_on_cuda, args=(batch_norm,)))
    total = float(sum(range(1, GPUS + 1)))
    for weights, summed in results:
        assert summed == [total] * 4
        for a, b in zip(weights, results[0][0]):
            np.testing.assert_array_equal(a, b)
        for a, ref in zip(weights, _reference(batch_norm)):
            np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-5)  # TF32 / cuBLAS against the CPU


def test_gpu_keras3_model_fits_on_cuda(gpu_strategy):
    import keras

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    with gpu_strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()

    def device_of_weights():
        import keras

        return str(keras.backend.convert_to_tensor(np.zeros(1, "float32")).device)

    assert all(d.startswith("cuda") for d in gpu_strategy.experimental_local_results(gpu_strategy.run(
        device_of_weights)))
