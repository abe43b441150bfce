"""The embedded default cluster: a ``LocalCluster`` (or ``LocalCUDACluster``) sized to the devices."""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from typing import Any

import dask

from daskdist import config
from daskdist.cluster.devices import DeviceSpec

__all__ = ["describe_worker", "local_gpu_count", "start_embedded_cluster", "worker_environment_config"]

logger = logging.getLogger(__name__)


def local_gpu_count() -> int:
    """CUDA devices visible to this process (0 without cupy or a driver)."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # cupy present, driver or device absent
        logger.debug("No usable CUDA device: %s", e)
        return 0


def describe_worker() -> dict[str, Any]:
    """Run on each worker (``client.run``): its host name and GPU count, for placement."""
    return {"host": socket.gethostname(), "gpus": local_gpu_count()}


def worker_environment_config() -> dict[str, Any]:
    """``dask.config`` settings for the environment of an embedded cluster's worker processes.

    Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` on its workers (to hand
    freed memory back to the OS). That also freezes glibc's mmap threshold at
    128 KiB, so every larger temporary array of a training step is a fresh
    mapping, page-faulted in and unmapped again: on this project's machines a
    CNN training step ran 1.7-1.8x slower (numpy and PyTorch alike). Training
    replicas allocate the same sizes every step, so the embedded cluster uses
    ``daskdist.embedded.malloc-trim-threshold`` instead (default ``null``:
    leave glibc's adaptive default).
    """
    value = config.get("embedded.malloc-trim-threshold")
    return {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None if value is None else int(value)}


def start_embedded_cluster(devices: list[DeviceSpec] | None) -> tuple[Any, list[DeviceSpec]]:
    """Start a local cluster with one single-threaded worker per device.

    ``devices=None`` means every GPU when there are GPUs and ``dask-cuda`` is
    installed, else one CPU replica per core (at least 2), or
    ``daskdist.embedded.n-workers`` when set.

    Returns
    -------
    cluster, devices
        The started cluster and the device each of its workers stands for, in
        worker order.

    Raises
    ------
    ValueError
        GPUs requested on a machine without a visible CUDA GPU, or a GPU index
        beyond the ones present.
    ImportError
        GPUs requested but ``dask-cuda`` is not installed.
    """
    wanted = config.get("embedded.n-workers")
    if devices is None:
        gpus = local_gpu_count()
        if gpus and importlib.util.find_spec("dask_cuda") is not None:
            devices = [DeviceSpec("GPU", i) for i in range(int(wanted or gpus))]
        else:
            count = int(wanted or max(2, os.cpu_count() or 1))
            devices = [DeviceSpec("CPU", i) for i in range(count)]
    if devices[0].device_type == "GPU":
        return _start_gpu_cluster(devices), devices
    from distributed import LocalCluster

    with dask.config.set(worker_environment_config()):
        cluster = LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=len(devices),
            threads_per_worker=1,
            processes=bool(config.get("embedded.processes")),
            dashboard_address=config.get("embedded.dashboard-address"),
            memory_limit=config.get("embedded.memory-limit"),
            silence_logs=logging.WARNING,
        )
    logger.info("Started an embedded LocalCluster with %d workers: %s", len(devices), cluster.dashboard_link)
    return cluster, devices


def _start_gpu_cluster(devices: list[DeviceSpec]) -> Any:
    gpus = local_gpu_count()
    if gpus == 0:
        raise ValueError(
            f"devices ask for GPUs ({', '.join(str(d) for d in devices)}) but this machine has no CUDA GPU "
            "visible to cupy; use CPU devices such as '/cpu:0', or run on a GPU machine with daskdist[gpu]"
        )
    too_high = [d for d in devices if d.index >= gpus]
    if too_high:
        raise ValueError(f"devices ask for {', '.join(map(str, too_high))} but this machine has {gpus} GPU(s)")
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as e:
        raise ImportError("GPU replicas need dask-cuda: pip install 'daskdist[gpu]'") from e
    with dask.config.set(worker_environment_config()):
        cluster = LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=[d.index for d in devices],
            threads_per_worker=1,
            dashboard_address=config.get("embedded.dashboard-address"),
            silence_logs=logging.WARNING,
        )
    logger.info("Started an embedded LocalCUDACluster with %d GPU workers: %s", len(devices), cluster.dashboard_link)
    return cluster
