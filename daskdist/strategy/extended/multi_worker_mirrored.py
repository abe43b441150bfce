"""``MultiWorkerMirroredExtended``: mirrored replicas on several hosts, ranked host by host; TF's cluster-spec checks."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from distributed import Client

from daskdist.cluster.devices import DeviceSpec
from daskdist.cluster.placement import Placement, WorkerInfo
from daskdist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    DaskClusterResolver,
)
from daskdist.cluster_resolver.selection import (
    HostGroup,
    WorkerRecord,
    address_host,
    group_by_host,
    placement_key,
    select_hosts,
)
from daskdist.group.service import STRATEGY, ReplicaService
from daskdist.ops import CommunicationOptions
from daskdist.replica.strategy_view import CLUSTER_RESOLVER_KEY
from daskdist.strategy.extended.elastic_options import ElasticOptions
from daskdist.strategy.extended.mirrored import MirroredExtended

__all__ = ["MultiWorkerMirroredExtended", "renumber_hosts", "validate_cluster_spec"]

logger = logging.getLogger(__name__)


#: The task types TF allows in a multi-worker cluster spec (``multi_worker_util._validate_cluster_spec``).
_ALLOWED_TASK_TYPES = ("chief", "worker", "evaluator", "ps", None)


def validate_cluster_spec(spec: ClusterSpec, task_type: str | None, task_id: int | None) -> None:
    """TensorFlow's checks of a non-empty spec and this program's task, with TF's messages.

    Raises
    ------
    ValueError
        No ``task_type``/``task_id``, a job or task type TF does not know, more
        than one chief or evaluator, or a ``task_id`` past the end of its job.
    """
    if task_type is None or task_id is None:
        raise ValueError("When `cluster_spec` is given, you must also specify `task_type` and `task_id`.")
    if any(job not in _ALLOWED_TASK_TYPES for job in spec.jobs):
        raise ValueError(f"Disallowed task type found in cluster spec. Allowed types are {_ALLOWED_TASK_TYPES} "
                         f"and the cluster spec is {spec}.")
    if task_type not in _ALLOWED_TASK_TYPES:
        raise ValueError(f"Unrecognized task_type: {task_type}, valid task types are: {_ALLOWED_TASK_TYPES}")
    if task_type not in spec.jobs and task_type != "evaluator":
        raise ValueError(f"`task_type` {task_type!r} not found in cluster_spec.")
    as_dict = spec.as_dict()
    if len(as_dict.get("chief", [])) > 1:
        raise ValueError("There must be at most one 'chief' job.")
    if len(as_dict.get("evaluator", [])) > 1:
        raise ValueError("There must be at most one 'evaluator' job.")
    if task_type in spec.jobs and task_id >= len(spec.job_tasks(task_type)):
        raise ValueError(f"The `task_id` {task_id} exceeds the maximum id of {task_type}.")


def renumber_hosts(groups: list[HostGroup], members: list[str]) -> tuple[list[HostGroup], list[int]]:
    """The hosts (TF workers) of a re-formed group, and each member's ``task_id``.

    Parameters
    ----------
    groups
        The hosts before, in task order, each with its Dask workers.
    members
        The new members' addresses in rank order (survivors in their old order, newcomers last).

    Returns
    -------
    The hosts that still hold members, in the order their first member ranks, and the ``task_id`` of each
    member (its host's index). A host whose members all left is dropped and the hosts after it move up; a
    newcomer joins the host whose workers share its address's host, else forms a new host at the end.
    """
    kept = [HostGroup(g.entry, tuple(a for a in g.workers if a in members)) for g in groups]
    live = [g for g in kept if g.workers]
    placed = {a for g in live for a in g.workers}
    for address in members:
        if address in placed:
            continue
        host = address_host(address)
        index = next((i for i, g in enumerate(live) if address_host(g.workers[0]) == host), None)
        if index is None:
            live.append(HostGroup(host, (address,)))
        else:
            live[index] = HostGroup(live[index].entry, (*live[index].workers, address))
    task_of = {a: i for i, g in enumerate(live) for a in g.workers}
    order = list(dict.fromkeys(task_of[a] for a in members))
    renumber = {old: new for new, old in enumerate(order)}
    return [live[old] for old in order], [renumber[task_of[a]] for a in members]


def _install_resolver(service: ReplicaService, resolver: DaskClusterResolver) -> None:
    """Replica command: leave this replica its resolver (``ctx.strategy.cluster_resolver``)."""
    service.objects.install(STRATEGY, CLUSTER_RESOLVER_KEY, resolver)


class MultiWorkerMirroredExtended(MirroredExtended):
    """Replicas on the Dask workers of several hosts, ranked host by host.

    Parameters
    ----------
    strategy
        The public strategy.
    cluster_resolver
        Selects and orders the hosts; a ``DaskClusterResolver`` without a
        selector, or an empty spec, means every worker of the cluster.
    resolver_given
        Whether the user passed ``cluster_resolver`` (else it is TF's default,
        a ``TFConfigClusterResolver``).
    options
        Group-wide ``CommunicationOptions``.
    client
        The ``distributed.Client`` (``None``: the default client, else an
        embedded local cluster, which is one host).
    elastic
        ``ElasticOptions`` (the group re-forms on the survivors of a loss), or ``None``.
    """

    def __init__(self, strategy: Any, cluster_resolver: ClusterResolver, resolver_given: bool,
                 options: CommunicationOptions, client: Client | None, elastic: ElasticOptions | None = None):
        self._resolver = cluster_resolver
        self._selection: ClusterSpec | None = None
        self.task_ids: list[int] = []
        self.host_groups: list[HostGroup] = []
        self._gpus: dict[str, int] = {}
        super().__init__(strategy, None, None, client, options=options, elastic=elastic)
        self._resolver_given = resolver_given
        try:
            if resolver_given or self._selection is not None:
                self.cluster_resolver: ClusterResolver = cluster_resolver
            else:
                self.cluster_resolver = DaskClusterResolver(self.client, workers=list(self.worker_addresses))
            self._install_replica_resolvers()
        except BaseException:
            self.close()
            raise

    # -- placement -------------------------------------------------------------------

    def _select_placements(self, workers: list[WorkerInfo], specs: list[DeviceSpec] | None,
                           embedded: bool) -> list[Placement]:
        """Hosts as TF workers: the resolver's hosts (or every host), their device-workers ranked host by host."""
        records = sorted((WorkerRecord(w.address, w.name, w.host) for w in workers), key=placement_key)
        if not records:
            raise ValueError("The Dask cluster has no workers; start some or pass a cluster with workers")
        self._gpus = {w.address: int(w.gpus) for w in workers}
        groups = self._select(records)
        if any(self._gpus.get(a, 0) for g in groups for a in g.workers):  # GPU workers are the devices
            groups = [HostGroup(g.entry, tuple(a for a in g.workers if self._gpus.get(a, 0))) for g in groups]
            groups = [g for g in groups if g.workers]
            kind = "GPU"
        else:
            kind = "CPU"
        host_of = {r.address: r.host for r in records}
        placements: list[Placement] = []
        self.task_ids = []
        for task_id, group in enumerate(groups):
            for address in group.workers:
                placements.append(Placement(len(placements), address, host_of[address], DeviceSpec(kind, len(placements))))
                self.task_ids.append(task_id)
        self.host_groups = groups
        counts = [len(g.workers) for g in groups]
        if len(set(counts)) > 1:
            warnings.warn(
                "MultiWorkerMirroredStrategy: the hosts hold different numbers of replicas "
                f"({', '.join(f'{g.entry}: {len(g.workers)}' for g in groups)}); it works, but TensorFlow leaves "
                "this undefined and the slowest host sets the pace",
                UserWarning, stacklevel=5,
            )
        logger.info("MultiWorkerMirroredStrategy: %d hosts (%s), %d replicas", len(groups),
                    ", ".join(f"{g.entry} x{len(g.workers)}" for g in groups), len(placements))
        return placements

    def _select(self, records: list[WorkerRecord]) -> list[HostGroup]:
        """The hosts to train on: chosen by the resolver's spec, or every host of the cluster."""
        resolver = self._resolver
        if isinstance(resolver, DaskClusterResolver):
            if resolver.has_ps:
                raise ValueError("MultiWorkerMirroredStrategy does not use parameter servers, but this "
                                 "DaskClusterResolver selects some (num_ps/ps); use ParameterServerStrategy")
            selector = resolver.selector
            if selector is None:
                return group_by_host(records)
            if isinstance(selector, list):
                by_address = {r.address: r for r in records}
                missing = [a for a in selector if a not in by_address]
                if missing:
                    raise ValueError(f"DaskClusterResolver's workers {missing} are not in the cluster; the Dask "
                                     f"workers are: {', '.join(by_address)}")
                return group_by_host([by_address[a] for a in selector])
            spec = selector.cluster_spec() if isinstance(selector, ClusterResolver) else selector
            return select_hosts(spec, records)
        spec = resolver.cluster_spec()
        if not spec:  # TF's local mode; here: every host of the Dask cluster
            return group_by_host(records)
        validate_cluster_spec(spec, resolver.task_type, resolver.task_id)
        self._selection = spec
        return select_hosts(spec, records)

    def membership_changed(self) -> None:
        """After an elastic group re-formed (members lost or admitted): hosts renumbered, resolvers replaced.

        Hosts keep their order; a host whose replicas all left is dropped and
        the hosts after it move up (TF's ``task_id`` of each remaining host is
        its new index); a newcomer joins its host's group, or forms a new host
        at the end. Every replica then gets a resolver of the new members.
        """
        members = list(self.worker_addresses)
        self.host_groups, self.task_ids = renumber_hosts(self.host_groups, members)
        logger.info("MultiWorkerMirroredStrategy re-formed: %d hosts (%s), %d replicas", len(self.host_groups),
                    ", ".join(f"{g.entry} x{len(g.workers)}" for g in self.host_groups), len(members))
        if not (self._resolver_given or self._selection is not None):
            self.cluster_resolver = DaskClusterResolver(self.client, workers=members)
        self._install_replica_resolvers()

    def _install_replica_resolvers(self) -> None:
        addresses = list(self.worker_addresses)
        resolvers = []
        for task_id in self.task_ids:
            resolver = DaskClusterResolver(workers=addresses, task_type="worker", task_id=task_id)
            resolver._accelerators = {a: self._gpus.get(a, 0) for a in addresses}
            resolvers.append((resolver,))
        self.run_on_replicas(_install_resolver, args_per_replica=resolvers)

    # -- properties ----------------------------------------------------------------------

    @property
    def num_hosts(self) -> int:
        """How many TF workers (hosts) the replicas span."""
        return len(self.host_groups)


