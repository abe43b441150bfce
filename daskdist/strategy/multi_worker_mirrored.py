"""``MultiWorkerMirroredStrategy``: synchronous training on several hosts, driven by one client.

A TensorFlow "worker" is a host; each Dask worker on it (one per GPU under
dask-cuda) is a replica. Replicas are ranked host by host, so ``task_id`` (the
host's index in placement order) and ``replica_id_in_sync_group`` follow TF's
``task_id * replicas_per_host + local_id``; the chief is the host of rank 0.
Collectives go through shared memory inside a host and one TCP ring between
hosts (``daskdist.collective`` chooses the hierarchical all-reduce by itself
when hosts hold several replicas); ``CommunicationOptions(implementation=RING)``
forces one flat ring over every replica.

Unlike TensorFlow, nobody runs the script on every host: one client places and
drives every replica. A ``cluster_resolver`` (``TF_CONFIG`` by default, as in
TF) only selects and orders the hosts.
"""

from __future__ import annotations

import warnings
from typing import Any

from distributed import Client

from daskdist.cluster_resolver import (
    ClusterResolver,
    TFConfigClusterResolver,
)
from daskdist.ops import CommunicationImplementation, CommunicationOptions
from daskdist.strategy.base import Strategy
from daskdist.strategy.extended.elastic_options import ElasticOptions
from daskdist.strategy.extended.multi_worker_mirrored import MultiWorkerMirroredExtended

__all__ = ["MultiWorkerMirroredStrategy", "MultiWorkerMirroredStrategyExperimental"]

class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training on the device-workers of several hosts (TF's ``MultiWorkerMirroredStrategy``).

    Parameters
    ----------
    cluster_resolver
        A ``dd.cluster_resolver.ClusterResolver``. ``None``: a
        ``TFConfigClusterResolver`` (TF's default); when ``TF_CONFIG`` has no
        cluster, every host of the Dask cluster. A spec's ``chief`` and
        ``worker`` entries (``host``, ``host:port`` or a Dask address) choose
        and order the hosts: an entry names the Dask worker with that exact
        address, else every worker on that host. A ``ps`` job is refused.
    communication_options
        ``dd.CommunicationOptions``: ``implementation=RING`` forces one flat ring
        over every replica (default: shared memory inside each host and one
        TCP ring between hosts); ``timeout_seconds`` is every collective's
        deadline; ``bytes_per_pack`` packs small tensors.
    client
        The ``distributed.Client`` of the cluster (``None``: the default
        client, else an embedded local cluster).
    elastic
        ``dd.ElasticOptions(min_replicas, ...)``: a lost worker (or a whole
        host) no longer ends ``fit`` or a ``dd.elastic.run`` loop; the
        survivors re-form, go back to the newest commit and go on, the hosts
        renumbered (``docs/elastic.md``). ``None`` (the default): a lost
        worker raises ``ReplicaLostError`` everywhere.

    Raises
    ------
    ValueError
        A ``cluster_resolver`` or ``communication_options`` of the wrong class,
        a non-empty spec without a task type or id, a malformed ``TF_CONFIG``
        (naming the variable), a ``ps`` job, or an entry that matches no Dask
        worker (naming it and the workers that exist).

    Examples
    --------
    >>> strategy = dd.MultiWorkerMirroredStrategy(client=client)   # doctest: +SKIP
    >>> strategy.cluster_resolver.cluster_spec().as_dict()          # doctest: +SKIP
    {'worker': ['10.0.0.5', '10.0.0.6']}
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 communication_options: CommunicationOptions | None = None, *, client: Client | None = None,
                 elastic: ElasticOptions | None = None):
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):  # TF raises ValueError for both
            raise ValueError(  # noqa: TRY004
                "communication_options must be an instance of dd.CommunicationOptions "
                "(TF's tf.distribute.experimental.CommunicationOptions), got "
                f"{type(communication_options).__name__}")
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        if not isinstance(resolver, ClusterResolver):
            raise ValueError(  # noqa: TRY004
                "cluster_resolver must be an instance of dd.cluster_resolver.ClusterResolver, got "
                f"{type(resolver).__name__}")
        self._multi_worker = MultiWorkerMirroredExtended(self, resolver, cluster_resolver is not None,
                                                         communication_options, client, elastic=elastic)
        super().__init__(self._multi_worker)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver given, else TF_CONFIG's when it named the hosts, else a live ``DaskClusterResolver``."""
        return self._multi_worker.cluster_resolver


class _ExperimentalMeta(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        # as in TF, instances of the new class pass isinstance checks against the deprecated one
        return isinstance(instance, MultiWorkerMirroredStrategy)


class MultiWorkerMirroredStrategyExperimental(MultiWorkerMirroredStrategy, metaclass=_ExperimentalMeta):
    """Deprecated: TF's ``tf.distribute.experimental.MultiWorkerMirroredStrategy(communication, cluster_resolver)``.

    Use ``dd.MultiWorkerMirroredStrategy``; ``communication`` becomes
    ``CommunicationOptions(implementation=communication)``.
    """

    def __init__(self, communication: CommunicationImplementation | str = CommunicationImplementation.AUTO,
                 cluster_resolver: ClusterResolver | None = None, *, client: Client | None = None):
        warnings.warn("experimental.MultiWorkerMirroredStrategy is deprecated: use dd.MultiWorkerMirroredStrategy "
                      "instead", DeprecationWarning, stacklevel=2)
        if isinstance(communication, str):
            try:
                communication = CommunicationImplementation[communication.upper()]
            except KeyError:
                raise ValueError(f"Unknown communication {communication!r}; expected one of "
                                 f"{', '.join(c.name for c in CommunicationImplementation)}") from None
        super().__init__(cluster_resolver, CommunicationOptions(implementation=communication), client=client)
