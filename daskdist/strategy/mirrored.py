"""``MirroredStrategy``: synchronous data parallelism, one replica per device-worker.

``MirroredExtended`` is the SPMD contract with TF's mirrored placement: a
copy of every variable on every replica (the default ``_variable_placement``).
"""

from __future__ import annotations

import logging

from distributed import Client

from daskdist.cluster.devices import DeviceSpec
from daskdist.cluster.placement import Placement, WorkerInfo
from daskdist.cross_device_ops import CrossDeviceOps
from daskdist.strategy.base import Strategy
from daskdist.strategy.elastic_options import ElasticOptions
from daskdist.strategy.spmd import SpmdExtended

__all__ = ["MirroredExtended", "MirroredStrategy"]

logger = logging.getLogger(__name__)


class MirroredExtended(SpmdExtended):
    """``MirroredStrategy``'s implementation (TF's ``MirroredExtended``): variables mirrored on every replica.

    ``MultiWorkerMirroredExtended`` subclasses it with another worker
    selection (``_select_placements``), as TF's ``CollectiveAllReduceExtended``
    subclasses ``MirroredExtended``.
    """

    def _select_placements(self, workers: list[WorkerInfo], specs: list[DeviceSpec] | None,
                           embedded: bool) -> list[Placement]:
        placed = super()._select_placements(workers, specs, embedded)
        if specs is None and not embedded:
            return _one_host(placed, type(self.strategy).__name__)
        return placed


def _one_host(placed: list[Placement], strategy_name: str) -> list[Placement]:
    """TF's MirroredStrategy is one machine: without ``devices``, keep the first host's workers (and say so)."""
    hosts = list(dict.fromkeys(p.host for p in placed))
    if len(hosts) <= 1:
        return placed
    kept = [p for p in placed if p.host == hosts[0]]
    logger.warning(
        "%s uses one machine, as in TensorFlow: the %d worker(s) on host %s (the cluster spans %d hosts: %s). "
        "Use dd.MultiWorkerMirroredStrategy to train on every host, or pass devices=...",
        strategy_name, len(kept), hosts[0], len(hosts), ", ".join(hosts),
    )
    return [Placement(i, p.address, p.host, DeviceSpec(p.device.device_type, i)) for i, p in enumerate(kept)]


class MirroredStrategy(Strategy):
    """Synchronous training on many replicas, variables mirrored on each (TF's ``MirroredStrategy``).

    Parameters
    ----------
    devices
        TF device strings (``["/gpu:0", "/gpu:1"]``, ``["/cpu:0", "CPU:1"]``).
        ``None``: every GPU worker if the cluster has any, else every worker;
        for the embedded cluster, every GPU, else one replica per core (at
        least 2).
    cross_device_ops
        ``dd.NcclAllReduce()``, ``dd.HierarchicalCopyAllReduce()`` or
        ``dd.ReductionToOneDevice()`` (TF's classes and arguments).
    client
        The ``distributed.Client`` of an existing cluster. ``None``: the
        default client if there is one, else an embedded ``LocalCluster``
        (``LocalCUDACluster`` on GPUs) that ``close()`` shuts down.
    elastic
        ``dd.ElasticOptions(min_replicas, ...)``: a lost worker no longer ends
        ``fit``; the survivors go back to the newest commit and go on
        (``docs/elastic.md``). ``None`` (the default): a lost worker raises
        ``ReplicaLostError`` everywhere.

    Examples
    --------
    >>> with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"]) as strategy:   # doctest: +SKIP
    ...     with strategy.scope():
    ...         v = dd.Variable(np.zeros(3), aggregation="MEAN")
    ...     strategy.run(lambda: v.assign_add(np.ones(3)))
    """

    def __init__(self, devices: list[str] | None = None, cross_device_ops: CrossDeviceOps | None = None, *,
                 client: Client | None = None, elastic: ElasticOptions | None = None):
        super().__init__(MirroredExtended(self, devices, cross_device_ops, client, elastic=elastic))
