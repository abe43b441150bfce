"""``DaskExtended``: the implementation behind ``MirroredStrategy`` and ``OneDeviceStrategy``.

It finds or starts the cluster, places one replica per device-worker,
launches the replica group, and turns the public API into commands for the
replicas. Client-side state is only handles (variables, the group); values
live on the replicas.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from dask.utils import parse_bytes
from distributed import Client, default_client

from daskdist import config, registry
from daskdist.arrays import as_array
from daskdist.cluster.devices import DeviceSpec, parse_devices
from daskdist.cluster.embedded import describe_worker, start_embedded_cluster
from daskdist.cluster.interrupts import EmbeddedShutdown
from daskdist.cluster.placement import Placement, WorkerInfo, place_replicas
from daskdist.cross_device_ops import CrossDeviceOps
from daskdist.exceptions import StrategyClosedError
from daskdist.group.handle import ReplicaGroup
from daskdist.group.spec import TRANSPORTS
from daskdist.ops import CommunicationOptions
from daskdist.replica import commands
from daskdist.values import check_num_components, regroup, select_replica
from daskdist.variables import (
    DistributedVariable,
    VariableAggregation,
    VariableSpec,
    VariableSynchronization,
    distributed_variable_class,
)

__all__ = ["DaskExtended"]

logger = logging.getLogger(__name__)


class DaskExtended:
    """Replicas of one strategy on a Dask cluster.

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
        Group-wide ``CommunicationOptions`` (``implementation=RING`` forces the
        flat ring); ``None``: the defaults.
    """

    def __init__(self, strategy: Any, devices: list[str] | None, cross_device_ops: CrossDeviceOps | None,
                 client: Client | None, options: CommunicationOptions | None = None):
        specs = parse_devices(devices) if devices is not None else None
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
        self.strategy = strategy
        self._cross_device_ops = cross_device_ops
        self._cluster: Any = None
        self._owns_client = False
        self._closed = False
        self._variables: dict[str, DistributedVariable] = {}
        self._datasets: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._variable_ids = itertools.count(1)
        self._lock = threading.Lock()

        if client is None:
            try:
                client = default_client()
            except ValueError:
                client = None
        if client is None:
            self._cluster, specs = start_embedded_cluster(specs)
            EmbeddedShutdown.register(self)  # SIGTERM and exit close it: replicas stop, segments go
            client = Client(self._cluster, set_as_default=False)
            self._owns_client = True
        self.client = client
        try:
            placements = self._place(specs, embedded=self._owns_client)
            algorithm = (cross_device_ops or CrossDeviceOps()).algorithm([p.device for p in placements])
            self._group = ReplicaGroup(
                client,
                placements,
                hosts=_replica_hosts(placements),
                algorithm=algorithm,
                options=options or CommunicationOptions(),
                transport=config.get("collective.transport"),
                shm_slot_bytes=parse_bytes(config.get("collective.shm.slot-bytes")),
                pin_cores=config.get("replica.pin-cores"),
                malloc=config.get("replica.malloc"),
            )
            self._group.launch()
        except BaseException:
            self._shutdown_cluster()
            raise
        registry.register(self.token, self)
        logger.info("%s: %d replicas on %s", type(strategy).__name__, len(placements), self._group.addresses)

    # -- placement -----------------------------------------------------------------

    def _place(self, specs: list[DeviceSpec] | None, embedded: bool) -> list[Placement]:
        described = self.client.run(describe_worker)  # the workers that answer are the ones to place on
        info = self.client.scheduler_info(n_workers=-1)["workers"]  # for their names (the placement order)
        workers = [
            WorkerInfo(address=a, name=str(info.get(a, {}).get("name", a)), host=d["host"], gpus=d["gpus"])
            for a, d in described.items()
        ]
        if embedded:  # the embedded cluster has exactly one worker per requested device, in order
            placed = place_replicas(workers, None)
            if specs is not None:
                placed = [Placement(p.rank, p.address, p.host, s) for p, s in zip(placed, specs)]
            return placed
        if specs is None:
            return _one_host(place_replicas(workers, None), type(self.strategy).__name__)
        return place_replicas(workers, specs)

    # -- properties ----------------------------------------------------------------

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
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables live: a copy on every replica's device."""
        return self.worker_devices

    @property
    def worker_addresses(self) -> tuple[str, ...]:
        """The Dask worker hosting each replica."""
        return tuple(self._group.addresses)

    @property
    def cross_device_ops(self) -> CrossDeviceOps | None:
        return self._cross_device_ops

    @property
    def group(self) -> ReplicaGroup:
        return self._group

    @property
    def should_checkpoint(self) -> bool:
        """Whether checkpointing is needed here: the client is the single writer, so ``True``."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether summaries (TensorBoard) are written here: the client is the single writer, so ``True``."""
        return True

    def check_open(self) -> None:
        if self._closed:
            raise StrategyClosedError("This strategy is closed; create a new one")

    # -- running -------------------------------------------------------------------

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run ``fn`` on every replica with its component of any distributed arguments."""
        self.check_open()
        check_num_components((args, kwargs), self.num_replicas)
        if _has_distributed((args, kwargs)):
            per_replica = [(fn, *select_replica(r, (args, kwargs))) for r in range(self.num_replicas)]
            results = self._group.call(commands.run_function, per_replica)
        else:
            results = self._group.call(commands.run_function, (fn, args, kwargs))
        return regroup(results)

    def step_timings(self, last: int | None = None) -> list[list[dict]]:
        self.check_open()
        return self._group.call(commands.step_timings, (last,))

    # -- variables -------------------------------------------------------------------

    def create_variable(self, *args: Any, **kwargs: Any) -> DistributedVariable:
        """``dd.Variable(...)`` inside ``scope()``: one copy per replica, initialised from the client."""
        self.check_open()
        value, spec = VariableSpec.build(*args, **kwargs)
        var_id = f"c{next(self._variable_ids)}"
        self._group.call(commands.create_variable, (var_id, value, spec))
        handle = distributed_variable_class(spec)(spec, self.token, var_id, owner=self)
        self._variables[var_id] = handle
        return handle

    def variable_handle(self, var_id: str, spec: VariableSpec) -> DistributedVariable:
        """The client's handle for a variable (also for ones created inside replica functions)."""
        with self._lock:
            handle = self._variables.get(var_id)
            if handle is None:
                handle = distributed_variable_class(spec)(spec, self.token, var_id, owner=self)
                self._variables[var_id] = handle
            return handle

    def read_variable(self, var_id: str, all_replicas: bool = False) -> Any:
        """One replica's copy (replica 0), or every replica's copy as a list."""
        self.check_open()
        if all_replicas:
            return self._group.call(commands.read_variable, (var_id,))
        return self._group.call(commands.read_variable, (var_id,), ranks=[0])[0]

    def update_variable(self, var_id: str, method: str, value: Any) -> None:
        """A cross-replica update from the client, applied to every copy.

        For a ``SyncOnReadVariable`` with SUM aggregation each copy gets
        ``value / num_replicas``, so that the aggregated read gives ``value``
        (TensorFlow's rule).
        """
        self.check_open()
        spec = self._variables[var_id]._spec
        if (
            spec.synchronization is VariableSynchronization.ON_READ
            and spec.aggregation is VariableAggregation.SUM
            and self.num_replicas > 1
        ):
            value = as_array(value)[0] / self.num_replicas
        self._group.call(commands.update_variable, (var_id, method, value))

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
            self.client.close()
            if self._cluster is not None:
                self._cluster.close()
            self._owns_client = False


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
    import optree

    from daskdist.values import DistributedValues

    leaves = optree.tree_leaves(structure, is_leaf=lambda x: isinstance(x, DistributedValues), none_is_leaf=True)
    return any(isinstance(leaf, DistributedValues) for leaf in leaves)
