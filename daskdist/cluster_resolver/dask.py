"""``DaskClusterResolver``: the Dask cluster as TensorFlow's resolvers describe a cluster.

For MultiWorkerMirroredStrategy a TF "worker" is a host; the Dask workers on
it are its devices (one replica each). For ParameterServerStrategy
(``num_ps=k`` or ``ps=[...]``) each Dask worker is one task: ``k`` of them
are ``ps``, the rest ``worker``; the client is the implicit ``chief``.
``cluster_spec()`` asks the scheduler on every call, so workers that come or
go show at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from daskdist.cluster.identity import scheduler_identity, scheduler_identity_from_worker
from daskdist.cluster_resolver.base import ClusterResolver, format_master_url
from daskdist.cluster_resolver.cluster_spec import ClusterSpec
from daskdist.cluster_resolver.selection import (
    HostGroup,
    WorkerRecord,
    address_host,
    choose_ps,
    group_by_host,
    placement_key,
    select_hosts,
    select_ps_roles,
)

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["DaskClusterResolver"]


class DaskClusterResolver(ClusterResolver):
    """The hosts of a Dask cluster as one ``worker`` job (a TF worker = a host; its Dask workers = replicas).

    Parameters
    ----------
    client
        A ``distributed.Client``. ``None``: inside a Dask worker (a replica),
        that worker's scheduler connection; elsewhere the default client.
    workers
        Which Dask workers count: a list of addresses (in placement order), or
        a ``ClusterSpec`` / ``ClusterResolver`` whose ``chief`` and ``worker``
        entries (``host``, ``host:port`` or a Dask address) select and order
        hosts. ``None``: every worker, in placement order (natural order of
        worker names).
    num_ps
        For ParameterServerStrategy: how many Dask workers become parameter
        servers (``ps``), chosen by ``selection.choose_ps``: spread over the
        hosts, from the end of each host's workers, the same choice for the
        same cluster. Every other Dask worker (of ``workers``, when given) is a
        ``worker``. The choice is made on the first ``cluster_spec()`` and then
        kept; workers that join later are ``worker`` tasks.
    ps
        The parameter servers by Dask address instead (overrides ``num_ps``).
    task_type, task_id
        ``None`` on the client (the single coordinator); inside a replica,
        ``"worker"`` and the index of its host.

    Raises
    ------
    ValueError
        ``num_ps`` negative (at once), or leaving no worker to train (when the
        spec is first asked for: TF's "There must be at least one worker.").

    Notes
    -----
    Without parameter servers, ``cluster_spec()`` lists one entry per host: the
    host as the Dask workers' addresses name it (an IP address or a name), in
    placement order. With them, ``{"ps": [...], "worker": [...]}`` of Dask
    worker addresses (one task per Dask worker; the client is the chief and is
    not listed). A ``workers`` spec or resolver with a ``ps`` job (TF_CONFIG's
    form) also selects parameter servers. ``master()`` is the scheduler's
    address and ``rpc_layer`` its scheme (``tcp``, ``tls``, ``ucx``).
    """

    def __init__(self, client: Client | None = None, *,
                 workers: Sequence[str] | ClusterSpec | ClusterResolver | None = None,
                 num_ps: int = 0, ps: Sequence[str] | None = None,
                 task_type: str | None = None, task_id: int | None = None):
        if client is not None:
            from distributed import Client

            if not isinstance(client, Client):
                raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}")
        if workers is not None and not isinstance(workers, (ClusterSpec, ClusterResolver)):
            if isinstance(workers, str) or not all(isinstance(w, str) for w in workers):
                raise TypeError("workers must be a list of Dask worker addresses, a ClusterSpec or a ClusterResolver")
            workers = list(workers)
        if isinstance(num_ps, bool) or not isinstance(num_ps, int):
            raise TypeError(f"num_ps must be an int, got {type(num_ps).__name__}")
        if num_ps < 0:
            raise ValueError(f"num_ps must be >= 0, got {num_ps}")
        if ps is not None and (isinstance(ps, str) or not all(isinstance(a, str) for a in ps)):
            raise TypeError("ps must be a list of Dask worker addresses")
        self._num_ps = len(ps) if ps is not None else num_ps
        self._ps: list[str] | None = list(ps) if ps is not None else None  # fixed once chosen
        self._client = client
        self._workers = workers
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer: str | None = None
        #: address -> GPU count, set by the strategy that already knows (inside replicas there is no client)
        self._accelerators: dict[str, int] | None = None

    @property
    def client(self) -> Any:
        """The ``distributed.Client`` given, or ``None`` (the default client is used)."""
        return self._client

    @property
    def selector(self) -> list[str] | ClusterSpec | ClusterResolver | None:
        """The ``workers`` given: addresses, a spec or resolver selecting hosts, or ``None`` (every worker)."""
        return self._workers

    # -- the live cluster --------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """The scheduler's identity (address and workers), asked now."""
        if self._client is not None:
            return scheduler_identity(self._client)
        try:
            from distributed import get_worker

            worker = get_worker()
        except ValueError:
            worker = None
        if worker is not None:
            return scheduler_identity_from_worker(worker)
        from distributed import default_client

        return scheduler_identity(default_client())  # type: ignore[no-untyped-call]

    def _records(self, identity: dict[str, Any]) -> list[WorkerRecord]:
        workers = identity.get("workers", {})
        records = [WorkerRecord(address, str(info.get("name", address)), address_host(address))
                   for address, info in workers.items()]
        return sorted(records, key=placement_key)

    @property
    def num_ps(self) -> int:
        """How many parameter servers this resolver selects (0: none, MultiWorkerMirrored's view)."""
        return self._num_ps

    @property
    def has_ps(self) -> bool:
        """Whether the spec has a ``ps`` job: ``num_ps``/``ps`` given, or a selector spec with one."""
        if self._num_ps > 0:
            return True
        selector = self._workers
        if isinstance(selector, ClusterResolver):
            selector = selector.cluster_spec()
        return isinstance(selector, ClusterSpec) and "ps" in selector.jobs

    def ps_roles(self) -> tuple[list[str], list[str]]:
        """``(ps addresses, worker addresses)`` now (the ps chosen once, then kept)."""
        records = self._records(self._identity())
        selector = self._workers
        if isinstance(selector, ClusterResolver):
            selector = selector.cluster_spec()
        if isinstance(selector, ClusterSpec) and "ps" in selector.jobs:
            return select_ps_roles(selector, records)
        if isinstance(selector, list):
            by_address = {r.address: r for r in records}
            records = [by_address[a] for a in selector if a in by_address]
        elif isinstance(selector, ClusterSpec):
            by_address = {r.address: r for r in records}
            records = [by_address[a] for g in select_hosts(selector, records) for a in g.workers]
        if self._ps is None:
            self._ps = choose_ps(records, self._num_ps)
        elif not self._ps_checked:
            known = {r.address for r in records}
            unknown = [a for a in self._ps if a not in known]
            if unknown:
                raise ValueError(f"DaskClusterResolver's ps {unknown} are not workers of the cluster; the Dask "
                                 f"workers are: {', '.join(sorted(known)) or 'none'}")
            if len(self._ps) >= len(records):
                raise ValueError("There must be at least one worker. Every Dask worker is a ps")
        self._ps_checked = True
        ps = set(self._ps)
        return list(self._ps), [r.address for r in records if r.address not in ps]

    _ps_checked = False

    def hosts(self) -> list[HostGroup]:
        """The TF workers now: each host's entry and its Dask workers, in placement order."""
        if self.has_ps:
            raise ValueError("MultiWorkerMirroredStrategy does not use parameter servers, but this "
                             "DaskClusterResolver selects some; use it with ParameterServerStrategy")
        records = self._records(self._identity())
        selector = self._workers
        if isinstance(selector, ClusterResolver):
            selector = selector.cluster_spec()
        if isinstance(selector, ClusterSpec):
            return select_hosts(selector, records)
        if selector is not None:
            by_address = {r.address: r for r in records}
            records = [by_address[a] for a in selector if a in by_address]
        return group_by_host(records)

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": [host, ...]}`` from the scheduler, now (empty when there are no workers).

        With parameter servers: ``{"ps": [address, ...], "worker": [address, ...]}``.
        """
        if self.has_ps:
            ps, workers = self.ps_roles()
            return ClusterSpec({"ps": ps, "worker": workers})
        groups = self.hosts()
        return ClusterSpec({"worker": [g.entry for g in groups]}) if groups else ClusterSpec({})

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The scheduler's address; with ``task_type`` and ``task_id``, that task's host (TF's rule)."""
        if task_type is not None and task_id is not None:
            return format_master_url(self.cluster_spec().task_address(task_type, task_id),
                                     rpc_layer or self.rpc_layer)
        return str(self._identity()["address"])

    @property
    def rpc_layer(self) -> str:
        """The scheduler address's scheme (``tcp``, ``tls``, ``ucx``, ...), unless set."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        address = self._identity()["address"]
        return address.split("://", 1)[0] if "://" in address else "tcp"

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """``{"GPU": n}`` for the GPU workers on one host (``{}`` for a CPU host).

        The host is ``task_id`` (or this resolver's ``task_id``, or host 0 on
        the client). Hosts may differ; MultiWorkerMirroredStrategy warns when
        they do.
        """
        index = task_id if task_id is not None else (self.task_id if self.task_id is not None else 0)
        if self.has_ps:  # one Dask worker per task
            ps, workers = self.ps_roles()
            job = task_type or self.task_type or "worker"
            members = ps if job == "ps" else workers
            if not 0 <= index < len(members):
                raise ValueError(f"No task with index {index!r} in job {job!r} ({len(members)} tasks)")
            gpus = self._gpu_counts([members[index]]).get(members[index], 0)
            return {"GPU": 1} if gpus else {}
        groups = self.hosts()
        if not 0 <= index < len(groups):
            raise ValueError(f"No task with index {index!r} in job 'worker' ({len(groups)} hosts)")
        addresses = list(groups[index].workers)
        if self._accelerators is not None:
            gpus = sum(1 for a in addresses if self._accelerators.get(a, 0) > 0)
        else:
            gpus = sum(1 for n in self._gpu_counts(addresses).values() if n > 0)
        return {"GPU": gpus} if gpus else {}

    def _gpu_counts(self, addresses: list[str]) -> dict[str, int]:
        from daskdist.cluster.embedded import local_gpu_count

        client = self._client
        if client is None:
            from distributed import default_client

            client = default_client()  # type: ignore[no-untyped-call]
        counts: dict[str, int] = client.run(local_gpu_count, workers=addresses)
        return counts

    @property
    def environment(self) -> str:
        return ""

    def __repr__(self) -> str:
        ps = f", num_ps={self._num_ps}" if self._num_ps else ""
        return f"DaskClusterResolver(task_type={self.task_type!r}, task_id={self.task_id!r}{ps})"
