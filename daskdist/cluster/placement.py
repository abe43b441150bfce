"""Which worker hosts which replica: pure functions over a description of the workers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from daskdist.cluster.devices import DeviceSpec

__all__ = ["Placement", "WorkerInfo", "place_replicas"]


@dataclass(frozen=True)
class WorkerInfo:
    """What placement needs to know about a worker."""

    address: str
    name: str
    host: str
    gpus: int = 0


@dataclass(frozen=True)
class Placement:
    """Replica ``rank`` runs on ``address`` and stands for ``device``."""

    rank: int
    address: str
    host: str
    device: DeviceSpec


def _natural_key(worker: WorkerInfo) -> tuple[Any, ...]:
    parts = re.split(r"(\d+)", str(worker.name))
    return (tuple(int(p) if p.isdigit() else p for p in parts), worker.address)


def place_replicas(workers: list[WorkerInfo], devices: list[DeviceSpec] | None) -> list[Placement]:
    """One replica per device-worker.

    With ``devices=None``: every GPU worker if there are any, else every worker.
    With devices: ``/cpu:k`` is the k-th worker and ``/gpu:k`` the k-th GPU
    worker, in the order of worker names (as dask-cuda and ``LocalCluster``
    number them).

    Raises
    ------
    ValueError
        No workers, more devices than matching workers, or GPUs asked of a
        cluster without GPU workers.
    """
    if not workers:
        raise ValueError("The Dask cluster has no workers; start some or pass a cluster with workers")
    ordered = sorted(workers, key=_natural_key)
    gpu_workers = [w for w in ordered if w.gpus > 0]
    if devices is None:
        chosen = gpu_workers or ordered
        kind = "GPU" if gpu_workers else "CPU"
        return [Placement(i, w.address, w.host, DeviceSpec(kind, i)) for i, w in enumerate(chosen)]
    kind = devices[0].device_type
    pool = gpu_workers if kind == "GPU" else ordered
    if kind == "GPU" and not pool:
        raise ValueError(
            f"devices ask for GPUs ({', '.join(str(d) for d in devices)}) but no worker of this cluster has a GPU"
        )
    too_high = [d for d in devices if d.index >= len(pool)]
    if too_high:
        raise ValueError(
            f"devices ask for {', '.join(str(d) for d in too_high)} but the cluster has only "
            f"{len(pool)} {kind} worker(s); one replica runs per worker"
        )
    return [Placement(i, pool[d.index].address, pool[d.index].host, d) for i, d in enumerate(devices)]
