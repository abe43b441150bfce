"""``SpmdExtended``: the contract over one replica group where every replica runs every step.

It finds or starts the cluster, selects the workers (``_select_placements``,
the hook ``MultiWorkerMirroredExtended`` overrides), launches the replica
group, and turns the contract's verbs into commands for the replicas.
Client-side state is only handles (variables, the group); values live on the
replicas. ``MirroredExtended`` and ``OneDeviceExtended`` build on it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import optree
from dask.utils import parse_bytes
from distributed import Client, default_client

from daskdist import config, registry
from daskdist.arrays import as_array
from daskdist.cluster.client_state import check_client_open
from daskdist.cluster.devices import DeviceSpec, parse_devices
from daskdist.cluster.embedded import describe_worker, start_embedded_cluster
from daskdist.cluster.identity import scheduler_workers
from daskdist.cluster.interrupts import EmbeddedShutdown
from daskdist.cluster.placement import Placement, WorkerInfo, place_replicas
from daskdist.cross_device_ops import CrossDeviceOps
from daskdist.exceptions import ReplicaLostError, StrategyClosedError
from daskdist.group.handle import ReplicaGroup
from daskdist.group.spec import TRANSPORTS
from daskdist.ops import CommunicationOptions
from daskdist.replica import commands
from daskdist.replica.launch import run_replica
from daskdist.strategy.drivers.contract import SpmdStepDriver, StepDriver
from daskdist.strategy.extended import replica_commands
from daskdist.strategy.extended.contract import Args, Command, Kwargs, StrategyExtended
from daskdist.strategy.extended.elastic_options import ElasticOptions
from daskdist.values import DistributedValues, regroup, select_replica
from daskdist.variables.distributed import (
    DistributedVariable,
    VariableAggregation,
    VariableSpec,
    VariableSynchronization,
    distributed_variable_class,
)

__all__ = ["SpmdExtended"]

logger = logging.getLogger(__name__)


class SpmdExtended(StrategyExtended):
    """Replicas of one strategy on a Dask cluster, all running every step (SPMD).

    Parameters
    ----------
    strategy
        The public strategy object this implements.
    devices
        TF device strings, or ``None`` for every device-worker.
    cross_device_ops
        A ``CrossDeviceOps`` choosing the all-reduce algorithm, or ``None``.
    client
        A ``distributed.Client``; ``None`` uses the default client if there is
        one, else starts an embedded local cluster.
    options
        Group-wide ``CommunicationOptions`` (TF's ``communication_options`` of
        the multi-worker strategy); ``None``: the defaults.
    elastic
        ``ElasticOptions``: the group's membership policy is ``elastic`` and
        ``fit`` survives lost workers (``daskdist.elastic``); ``None``: ``fixed``.

    Notes
    -----
    Construction runs in steps a subclass can replace one by one:
    ``_check_arguments``, ``_connect`` (client or embedded cluster),
    ``_discover_workers``, ``_select_placements`` (which workers, in which
    order, on which devices) and ``_launch_group``.
    """

    def __init__(self, strategy: Any, devices: list[str] | None, cross_device_ops: CrossDeviceOps | None,
                 client: Client | None, options: CommunicationOptions | None = None,
                 elastic: ElasticOptions | None = None):
        specs = parse_devices(devices) if devices is not None else None
        self._check_arguments(cross_device_ops, client)
        check_client_open(client, type(strategy).__name__)
        if elastic is not None and not isinstance(elastic, ElasticOptions):
            raise TypeError(f"elastic must be a dd.ElasticOptions or None, got {type(elastic).__name__}")
        self.strategy = strategy
        self._elastic = elastic
        self._cross_device_ops = cross_device_ops
        self._options = options or CommunicationOptions()
        self._cluster: Any = None
        self._owns_client = False
        self._closed = False
        self._variables: dict[str, DistributedVariable] = {}
        #: The workers holding each variable created in ``scope()`` (``None``: every replica); workers, not
        #: ranks, because ranks change when the group moves to a new membership generation (elastic).
        self._holders: dict[str, list[str] | None] = {}
        self._datasets: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._variable_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._client, specs = self._connect(client, specs)
        try:
            placements = self._select_placements(self._discover_workers(), specs, embedded=self._owns_client)
            self._group = self._launch_group(placements)
        except BaseException:
            self._shutdown_cluster()
            raise
        registry.register(self.token, self)
        logger.info("%s: %d replicas on %s", type(strategy).__name__, len(placements), self._group.addresses)

    # -- construction steps ------------------------------------------------------------

    def _check_arguments(self, cross_device_ops: CrossDeviceOps | None, client: Client | None) -> None:
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                "cross_device_ops must be a dd.CrossDeviceOps such as dd.NcclAllReduce(), "
                f"dd.HierarchicalCopyAllReduce() or dd.ReductionToOneDevice(); got {type(cross_device_ops).__name__}"
            )
        if client is not None and not isinstance(client, Client):
            raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}")
        transport = config.get("collective.transport")
        if transport not in TRANSPORTS:
            raise ValueError(
                f"daskdist.collective.transport is {transport!r}; expected one of {', '.join(TRANSPORTS)}"
            )

    def _connect(self, client: Client | None,
                 specs: list[DeviceSpec] | None) -> tuple[Client, list[DeviceSpec] | None]:
        """The client to use: the given one, the default one, or one of a new embedded cluster."""
        if client is None:
            try:
                client = default_client()  # type: ignore[no-untyped-call]  # distributed is untyped
            except ValueError:
                client = None
        if client is None:
            self._cluster, specs = start_embedded_cluster(specs)
            EmbeddedShutdown.register(self)  # SIGTERM and exit close it: replicas stop, segments go
            client = Client(self._cluster, set_as_default=False)  # type: ignore[no-untyped-call]
            self._owns_client = True
        return client, specs

    def _discover_workers(self) -> list[WorkerInfo]:
        """The workers that answer, with their host and GPUs, named as the scheduler names them."""
        described = self.client.run(describe_worker)  # the workers that answer are the ones to place on
        info = scheduler_workers(self.client)  # for their names (the placement order)
        return [
            WorkerInfo(address=a, name=str(info.get(a, {}).get("name", a)), host=d["host"], gpus=d["gpus"])
            for a, d in described.items()
        ]

    def _select_placements(self, workers: list[WorkerInfo], specs: list[DeviceSpec] | None,
                           embedded: bool) -> list[Placement]:
        """Rank -> worker and device. The hook a multi-worker strategy overrides."""
        if embedded:  # the embedded cluster has exactly one worker per requested device, in order
            placed = place_replicas(workers, None)
            if specs is not None:
                placed = [Placement(p.rank, p.address, p.host, s) for p, s in zip(placed, specs)]
            return placed
        return place_replicas(workers, specs)

    def _launch_group(self, placements: list[Placement]) -> ReplicaGroup:
        """Start one replica per placement and wait for their rendezvous."""
        algorithm = (self._cross_device_ops or CrossDeviceOps()).algorithm([p.device for p in placements])
        group = ReplicaGroup(
            self.client,
            placements,
            run_replica,
            hosts=_replica_hosts(placements),
            algorithm=algorithm,
            options=self._options,
            transport=config.get("collective.transport"),
            shm_slot_bytes=parse_bytes(config.get("collective.shm.slot-bytes")),
            pin_cores=config.get("replica.pin-cores"),
            malloc=config.get("replica.malloc"),
            policy="elastic" if self._elastic is not None else None,  # None: daskdist.group.membership-policy
        )
        group.launch()
        return group

    # -- properties ----------------------------------------------------------------

    @property
    def elastic(self) -> ElasticOptions | None:
        """``ElasticOptions`` when the strategy is elastic (its group's membership policy is then ``elastic``)."""
        return self._elastic

    @property
    def token(self) -> str:
        """The strategy's identity, what its handles pickle: not the group's id, so it outlives generations."""
        return self._group.strategy_token

    @property
    def num_replicas(self) -> int:
        return self._group.size

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The device string of each replica, in replica order."""
        return tuple(self._group.membership.devices)

    @property
    def worker_addresses(self) -> tuple[str, ...]:
        """The Dask worker hosting each replica."""
        return tuple(self._group.addresses)

    @property
    def client(self) -> Client:
        return self._client

    @property
    def cross_device_ops(self) -> CrossDeviceOps | None:
        return self._cross_device_ops

    @property
    def group(self) -> ReplicaGroup:
        """The replica group handle (the SPMD transport of the contract's commands)."""
        return self._group

    def membership_changed(self) -> None:
        """Called by elastic training once the group re-formed (members lost or admitted) and holds one commit.

        Nothing to do here; ``MultiWorkerMirroredExtended`` renumbers its hosts
        and gives every replica a resolver of the new members.
        """

    def check_open(self) -> None:
        if self._closed:
            raise StrategyClosedError("This strategy is closed; create a new one")

    # -- running -------------------------------------------------------------------

    def _call_for_each_replica(self, fn: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        if _has_distributed((args, kwargs)):
            per_replica = [(fn, *select_replica(r, (args, kwargs))) for r in range(self.num_replicas)]
            results = self._group.call(commands.run_function, per_replica)
        else:
            results = self._group.call(commands.run_function, (fn, args, kwargs))
        return regroup(results)

    def _run_on(self, command: Command, args: Args | list[Args], ranks: list[int] | None) -> list[Any]:
        return self._group.call(command, args, ranks=ranks)

    def step_driver(self, key: str | None = None) -> StepDriver:
        """All-reduce the gradients, apply on every replica (``training_contract.SpmdStepDriver``).

        An Extended that places variables otherwise (a parameter holder) must define its own driver.

        Raises
        ------
        TypeError
            This Extended overrides ``_variable_placement`` but not ``step_driver``.
        """
        if type(self)._variable_placement is not StrategyExtended._variable_placement:
            raise TypeError(
                f"{type(self).__name__} places variables with its own _variable_placement, so the all-reduce "
                "step driver cannot train its parameters: define step_driver too (see training_contract)")
        return SpmdStepDriver()

    def step_timings(self, last: int | None = None) -> list[list[Kwargs]]:
        self.check_open()
        return self._group.call(commands.step_timings, (last,))

    # -- variables -------------------------------------------------------------------

    def create_variable(self, *args: Any, **kwargs: Any) -> DistributedVariable:
        """``dd.Variable(...)`` inside ``scope()``: a copy on each replica ``_variable_placement`` names."""
        self.check_open()
        value, spec = VariableSpec.build(*args, **kwargs)
        holders = list(self._colocation) if self._colocation is not None else self._variable_placement(spec)
        var_id = f"c{next(self._variable_ids)}"
        self._group.call(commands.create_variable, (var_id, value, spec), ranks=self._ranks(holders))
        handle = distributed_variable_class(spec)(spec, self.token, var_id, owner=self)
        with self._lock:
            everyone = holders == list(range(self.num_replicas))
            self._holders[var_id] = None if everyone else [self._group.addresses[r] for r in holders]
            self._variables[var_id] = handle
        return handle

    def _variable_holders(self, var_id: str) -> list[int]:
        """Replicas holding ``var_id`` (their current ranks): as placed, or all (variables made inside replica
        functions, and those placed on every replica).

        Raises
        ------
        ReplicaLostError
            Every worker that held the variable has left the group.
        """
        workers = self._holders.get(var_id)
        if workers is None:
            return list(range(self.num_replicas))
        members = self._group.addresses
        ranks = [members.index(w) for w in workers if w in members]
        if not ranks:
            raise ReplicaLostError(f"variable {var_id} was held only by {workers}, which left the group",
                                   worker=workers[0])
        return ranks

    def _ranks(self, holders: list[int]) -> list[int] | None:
        return None if holders == list(range(self.num_replicas)) else holders

    def variable_handle(self, var_id: str, spec: VariableSpec) -> DistributedVariable:
        with self._lock:
            handle = self._variables.get(var_id)
            if handle is None:
                handle = distributed_variable_class(spec)(spec, self.token, var_id, owner=self)
                self._variables[var_id] = handle
            return handle

    def read_variable(self, var_id: str, all_replicas: bool = False) -> Any:
        """The first holder's copy, or every holder's copy as a list."""
        self.check_open()
        holders = self._variable_holders(var_id)
        if all_replicas:
            return self._group.call(commands.read_variable, (var_id,), ranks=self._ranks(holders))
        return self._group.call(commands.read_variable, (var_id,), ranks=holders[:1])[0]

    def update_variable(self, var_id: str, method: str, value: Any) -> None:
        """A cross-replica update from the client, applied to every copy.

        For a ``SyncOnReadVariable`` with SUM aggregation each copy gets
        ``value / copies``, so that the aggregated read gives ``value``
        (TensorFlow's rule).
        """
        self.check_open()
        spec = self._variables[var_id].spec
        holders = self._variable_holders(var_id)
        if (
            spec.synchronization is VariableSynchronization.ON_READ
            and spec.aggregation is VariableAggregation.SUM
            and len(holders) > 1
        ):
            value = as_array(value)[0] / len(holders)
        self._group.call(commands.update_variable, (var_id, method, value), ranks=self._ranks(holders))

    def _update(self, var: DistributedVariable, fn: Callable[..., Any], args: Args, kwargs: Kwargs,
                holders: list[int]) -> list[Any]:
        per_rank: list[Args] = [()] * self.num_replicas
        for index, rank in enumerate(holders):
            per_rank[rank] = (var, fn, *select_replica(index, (args, kwargs)))
        return self._group.call(replica_commands.update_copy, per_rank, ranks=self._ranks(holders))

    # -- datasets --------------------------------------------------------------------

    def register_distributed_dataset(self, dataset_id: str, dataset: Any) -> None:
        self._datasets[dataset_id] = dataset

    def distributed_dataset(self, dataset_id: str) -> Any:
        return self._datasets.get(dataset_id)

    # -- closing -------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        registry.unregister(self.token)
        try:
            self._group.close()
        finally:
            self._variables.clear()
            self._shutdown_cluster()

    def _shutdown_cluster(self) -> None:
        EmbeddedShutdown.unregister(self)
        if self._owns_client:
            self._client.close()  # type: ignore[no-untyped-call]
            if self._cluster is not None:
                self._cluster.close()
            self._owns_client = False


def _replica_hosts(placements: list[Placement]) -> list[str]:
    """The host of each replica as transports and algorithms see it (``daskdist.collective.hosts``).

    ``auto``: the real host names. ``per-worker``: every worker its own host.
    ``blocks:N``: consecutive replicas in groups of N per host. The last two
    run the cross-host and hierarchical paths on one machine.
    """
    mode = str(config.get("collective.hosts"))
    if mode == "per-worker":
        return [p.address for p in placements]
    if mode.startswith("blocks:") and mode[7:].isdigit() and int(mode[7:]) > 0:
        per_host = int(mode[7:])
        return [f"host-{p.rank // per_host}" for p in placements]
    if mode != "auto":
        raise ValueError(f"daskdist.collective.hosts must be 'auto', 'per-worker' or 'blocks:N', got {mode!r}")
    return [p.host for p in placements]


def _has_distributed(structure: Any) -> bool:
    leaves = optree.tree_leaves(structure, is_leaf=lambda x: isinstance(x, DistributedValues), none_is_leaf=True)
    return any(isinstance(leaf, DistributedValues) for leaf in leaves)
