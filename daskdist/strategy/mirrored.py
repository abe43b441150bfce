"""``MirroredStrategy``: synchronous data parallelism, one replica per device-worker.

``MirroredExtended`` is the SPMD contract with TF's mirrored placement: a
copy of every variable on every replica (the default ``_variable_placement``).
"""

from __future__ import annotations

from distributed import Client

from daskdist.cross_device_ops import CrossDeviceOps
from daskdist.strategy.base import Strategy
from daskdist.strategy.extended.elastic_options import ElasticOptions
from daskdist.strategy.extended.mirrored import MirroredExtended

__all__ = ["MirroredStrategy"]


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
