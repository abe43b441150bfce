"""Pure functions: group Dask workers into hosts, and map a ``ClusterSpec``'s entries onto them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from daskdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["HostGroup", "WorkerRecord", "address_host", "choose_ps", "group_by_host", "match_entry", "placement_key",
           "select_hosts", "select_ps_roles", "split_address"]

#: The jobs whose tasks train under MultiWorkerMirroredStrategy, in TF's order (the chief is task 0).
TRAINING_JOBS = ("chief", "worker")


@dataclass(frozen=True)
class WorkerRecord:
    """A Dask worker as the resolvers see it.

    Attributes
    ----------
    address
        Its Dask address (``tcp://10.0.0.5:40331``).
    name
        Its Dask name (the placement order sorts by it).
    host
        The host it runs on: its host name when known (what daskdist groups
        replicas by), else the host part of its address.
    """

    address: str
    name: str
    host: str


@dataclass(frozen=True)
class HostGroup:
    """One TF "worker": a host (or one Dask worker named exactly) and the Dask workers it stands for."""

    entry: str
    workers: tuple[str, ...]


def split_address(address: str) -> tuple[str, str | None]:
    """``(host, port)`` of ``[scheme://]host[:port]`` (IPv6 in brackets); ``port`` ``None`` when absent."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        return host, tail[1:] if tail.startswith(":") else None
    if rest.count(":") == 1:
        host, port = rest.split(":")
        return host, port
    return rest, None


def address_host(address: str) -> str:
    """The host part of a Dask address (``inproc://10.0.0.1/123/4`` -> ``10.0.0.1``)."""
    return split_address(address)[0].split("/", 1)[0]


def placement_key(worker: WorkerRecord) -> tuple[Any, ...]:
    """Natural order of worker names (``w2`` before ``w10``), as ``place_replicas`` orders them."""
    parts = re.split(r"(\d+)", str(worker.name))
    return (tuple(int(p) if p.isdigit() else p for p in parts), worker.address)


def group_by_host(workers: Sequence[WorkerRecord]) -> list[HostGroup]:
    """Workers grouped by host, hosts in the order of their first worker (workers keep their order)."""
    groups: dict[str, list[str]] = {}
    for w in workers:
        groups.setdefault(w.host, []).append(w.address)
    return [HostGroup(host, tuple(addresses)) for host, addresses in groups.items()]


def match_entry(entry: str, workers: Sequence[WorkerRecord]) -> tuple[str, ...]:
    """The Dask workers a ``ClusterSpec`` entry names: the one with that exact address, else all on that host.

    An entry is ``host``, ``host:port`` or ``scheme://host:port``; ``host`` is
    compared with each worker's host name and with the host of its address.
    Returns ``()`` when nothing matches.
    """
    host, port = split_address(entry)
    if port is not None:
        exact = [w.address for w in workers if split_address(w.address) == (host, port)]
        if exact:
            return tuple(exact)
    return tuple(w.address for w in workers if host in (w.host, address_host(w.address)))


def select_hosts(spec: ClusterSpec, workers: Sequence[WorkerRecord]) -> list[HostGroup]:
    """The TF workers of ``spec`` (its ``chief`` then ``worker`` tasks, by index) mapped onto Dask workers.

    Raises
    ------
    ValueError
        The spec has a ``ps`` job (parameter servers are not part of
        MultiWorkerMirroredStrategy), no chief or worker task, an entry that
        matches no Dask worker (the message names it and lists the workers that
        exist), or two entries that name the same Dask worker.
    """
    if "ps" in spec.jobs:
        raise ValueError(
            f"MultiWorkerMirroredStrategy does not use parameter servers, but the cluster spec has a 'ps' job "
            f"({spec.as_dict()['ps']}); remove it, or use ParameterServerStrategy"
        )
    entries = [spec.task_address(job, i) for job in TRAINING_JOBS if job in spec.jobs for i in spec.task_indices(job)]
    if not entries:
        raise ValueError(f"The cluster spec {spec!r} has no 'chief' or 'worker' task to train on")
    groups: list[HostGroup] = []
    owner: dict[str, str] = {}
    for entry in entries:
        matched = match_entry(entry, workers)
        if not matched:
            existing = ", ".join(f"{w.address} (host {w.host})" for w in workers) or "none"
            raise ValueError(f"The cluster spec entry {entry!r} matches no Dask worker; the Dask workers are: {existing}")
        for address in matched:
            if address in owner:
                raise ValueError(f"The cluster spec entries {owner[address]!r} and {entry!r} both name the Dask "
                                 f"worker {address}; each worker can belong to one task only")
            owner[address] = entry
        groups.append(HostGroup(entry, matched))
    return groups


def choose_ps(workers: Sequence[WorkerRecord], num_ps: int) -> list[str]:
    """The ``num_ps`` Dask workers that become parameter servers: spread over hosts, deterministic.

    Hosts are taken in placement order, and each round gives one more ps to
    every host in turn, from the *end* of that host's workers (so the first
    workers of each host, where rank 0 of other groups tends to go, keep
    training). With one host and workers ``w0..w3``, ``num_ps=2`` picks
    ``w3`` and ``w2``; with two hosts of two workers, the last worker of each.
    The same workers give the same choice.

    Raises
    ------
    ValueError
        ``num_ps`` leaves no Dask worker to train (TF's "There must be at
        least one worker."), or is negative.
    """
    if num_ps < 0:
        raise ValueError(f"num_ps must be >= 0, got {num_ps}")
    if num_ps >= len(workers):
        raise ValueError(f"There must be at least one worker. num_ps={num_ps} takes every one of the "
                         f"{len(workers)} Dask workers of the cluster as a parameter server")
    remaining = [list(g.workers) for g in group_by_host(workers)]
    chosen: list[str] = []
    while len(chosen) < num_ps:
        for addresses in remaining:
            if addresses and len(chosen) < num_ps:
                chosen.append(addresses.pop())
    return chosen


def select_ps_roles(spec: ClusterSpec, workers: Sequence[WorkerRecord]) -> tuple[list[str], list[str]]:
    """``(ps, worker)`` Dask addresses for a spec with a ``ps`` job (TF_CONFIG's parameter-server form).

    Each ``ps`` entry names one Dask worker (its exact address or ``host:port``;
    a bare host names the first worker on it not taken yet); each ``chief`` or
    ``worker`` entry names the Dask workers it matches (an exact address: that
    one; a host: every worker on it not already a ps).

    Raises
    ------
    ValueError
        An entry that matches no Dask worker (the message names it), or a
        Dask worker named twice.
    """
    existing = ", ".join(f"{w.address} (host {w.host})" for w in workers) or "none"
    taken: dict[str, str] = {}
    ps: list[str] = []
    for i in spec.task_indices("ps"):
        entry = spec.task_address("ps", i)
        free = [a for a in match_entry(entry, workers) if a not in taken]
        if not free:
            raise ValueError(f"The cluster spec's ps entry {entry!r} matches no free Dask worker; the Dask "
                             f"workers are: {existing}")
        taken[free[0]] = entry
        ps.append(free[0])
    trainers: list[str] = []
    for job in TRAINING_JOBS:
        for i in spec.task_indices(job) if job in spec.jobs else []:
            entry = spec.task_address(job, i)
            matched = match_entry(entry, workers)
            if not matched:
                raise ValueError(f"The cluster spec entry {entry!r} matches no Dask worker; the Dask workers "
                                 f"are: {existing}")
            exact = len(matched) == 1 and split_address(entry)[1] is not None
            for address in matched:
                if address in taken:
                    if exact:
                        raise ValueError(f"The cluster spec entries {taken[address]!r} and {entry!r} both name "
                                         f"the Dask worker {address}; each worker can belong to one task only")
                    continue
                taken[address] = entry
                trainers.append(address)
    return ps, trainers
