"""Pure functions: group Dask workers into hosts, and map a ``ClusterSpec``'s entries onto them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from daskdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["HostGroup", "WorkerRecord", "address_host", "group_by_host", "match_entry", "placement_key",
           "select_hosts", "split_address"]

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


def placement_key(worker: WorkerRecord) -> tuple:
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
