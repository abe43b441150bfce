"""GPU replicas (cupy arrays, LocalCUDACluster). Skipped where there is no cupy, CUDA GPU or dask-cuda."""

from __future__ import annotations

import pytest

from daskdist.cluster.embedded import local_gpu_count

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
pytest.importorskip("dask_cuda")
if local_gpu_count() == 0:
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

import daskdist as dd  # noqa: E402


def test_gpu_replicas_all_reduce_cupy_arrays():
    with dd.MirroredStrategy(devices=["/gpu:0"]) as strategy:
        assert strategy.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:GPU:0",)
        with strategy.scope():
            v = dd.Variable(cupy.zeros(4, cupy.float32), aggregation="MEAN")

        def fn():
            x = cupy.arange(4, dtype=cupy.float32)
            total = dd.get_replica_context().all_reduce("SUM", {"x": x})
            v.assign_add(total["x"])
            return type(total["x"]).__module__

        out = strategy.run(fn)
        assert str(out).startswith("cupy")
        assert v.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
