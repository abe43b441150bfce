"""``ParameterServerExtended``: variables on ps members, one one-replica group per worker; the coordinator's dataset."""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from dask.utils import parse_bytes
from distributed import Client, default_client

from daskdist import config, context, registry
from daskdist.cluster.client_state import check_client_open
from daskdist.cluster.devices import DeviceSpec
from daskdist.cluster.embedded import describe_worker
from daskdist.cluster.identity import scheduler_workers
from daskdist.cluster.placement import Placement
from daskdist.cross_device_ops import CrossDeviceOps
from daskdist.exceptions import StrategyClosedError
from daskdist.group.handle import ReplicaGroup
from daskdist.group.service import STRATEGY
from daskdist.ops import CommunicationOptions
from daskdist.replica.launch import run_replica
from daskdist.strategy.drivers.contract import StepDriver
from daskdist.strategy.drivers.held import PsStepDriver
from daskdist.strategy.extended.contract import Args, Command, Kwargs
from daskdist.strategy.extended.default import OneReplicaContext
from daskdist.strategy.extended.parameter_holder import ParameterHolderExtended

if TYPE_CHECKING:
    from daskdist.ps.client import StoreRef
    from daskdist.variables.distributed import VariableSpec

__all__ = ["PS_STRATEGY_KEY", "RUN_WITHOUT_SCHEDULE", "DatasetForEachWorker", "ParameterServerExtended", "cluster_members"]

logger = logging.getLogger(__name__)


_TASK_TYPES = ("chief", "ps", "worker")

#: TensorFlow's warning (``parameter_server_strategy_v2.py``) when ``run`` is called on the coordinator.
RUN_WITHOUT_SCHEDULE = (
    "A `tf.distribute.experimental.ParameterServerStrategy` method is invoked without using "
    "`ClusterCoordinator.schedule`. If you are not tracing a tf.function, this method is possibly executed on the "
    "coordinator, which can be slow. To properly dispatch functions to run on workers, methods like `run` or "
    "`reduce` should be used within a function passed to "
    "`tf.distribute.experimental.coordinator.ClusterCoordinator.schedule`."
)

#: The resident a parameter-server worker keeps: the token of the strategy it works for.
PS_STRATEGY_KEY = (STRATEGY, "parameter-server")


def cluster_members(cluster_resolver: Any) -> tuple[list[str], list[str]]:
    """``(ps addresses, worker addresses)`` from a resolver, with TensorFlow's checks (PSV2 ``__init__``).

    Raises
    ------
    ValueError
        An empty spec, a task type other than chief/ps/worker, no ps or no
        worker, more than one chief, or a resolver whose own ``task_type``
        is none of TF's.
    """
    if not hasattr(cluster_resolver, "cluster_spec"):
        raise TypeError(f"cluster_resolver must be a ClusterResolver (with cluster_spec()), "
                        f"got {type(cluster_resolver).__name__}")
    spec = cluster_resolver.cluster_spec()
    jobs = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec or {})
    if not jobs:
        raise ValueError("Cluster spec must be non-empty in `tf.distribute.cluster_resolver.ClusterResolver`.")
    for job in jobs:
        if job not in _TASK_TYPES:
            raise ValueError(f"Disallowed task type found in cluster spec. Allowed types are {list(_TASK_TYPES)} "
                             f"and the cluster spec is {jobs}.")
    task_type = getattr(cluster_resolver, "task_type", None)
    if task_type not in (*_TASK_TYPES, "evaluator", None):  # TF's multi_worker_util._validate_cluster_spec
        raise ValueError(f"Unrecognized task_type: {task_type}, valid task types are: "
                         f"{(*_TASK_TYPES, 'evaluator', None)}")
    if len(_addresses(jobs.get("chief"))) > 1:
        raise ValueError("There must be at most one 'chief' job.")
    ps, workers = _addresses(jobs.get("ps")), _addresses(jobs.get("worker"))
    if not ps:
        raise ValueError("There must be at least one ps.")
    if not workers:
        raise ValueError("There must be at least one worker.")
    if set(ps) & set(workers):
        raise ValueError(f"a Dask worker cannot be both a ps and a worker: {sorted(set(ps) & set(workers))}")
    return ps, workers


def _match_workers(entries: list[str], known: dict[str, Any]) -> list[str]:
    """Dask worker addresses for spec entries: a full address, or ``host:port`` (TF_CONFIG's form).

    Raises
    ------
    ValueError
        An entry that names no worker of the cluster (never a hang).
    """
    by_host_port = {a.split("://", 1)[-1]: a for a in known}
    matched, unknown = [], []
    for entry in entries:
        address = entry if entry in known else by_host_port.get(str(entry).split("://", 1)[-1])
        if address is None:
            unknown.append(entry)
        else:
            matched.append(address)
    if unknown:
        raise ValueError(f"the cluster spec names {unknown}, which are not workers of this Dask cluster "
                         f"(workers: {sorted(known)})")
    return matched


def _addresses(job: Any) -> list[str]:
    if job is None:
        return []
    if isinstance(job, dict):
        return [job[k] for k in sorted(job)]
    return list(job)


class ParameterServerExtended(ParameterHolderExtended):
    """Stores on the ps members, one single-replica group per worker (TF's ``ParameterServerStrategyV2Extended``).

    It reuses the parameter-holder contract (variable creation, placement,
    partitioning, reads and updates from the client) and replaces the SPMD
    group by one group per worker.
    """

    def __init__(self, strategy: Any, cluster_resolver: Any, variable_partitioner: Any, client: Client | None):
        ps, workers = cluster_members(cluster_resolver)
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(f"variable_partitioner must be a partitioner, got {type(variable_partitioner).__name__}")
        if client is None:
            # DaskClusterResolver(client=...) names the cluster's client; other resolvers: the default client
            client = getattr(cluster_resolver, "client", None) or default_client()  # type: ignore[no-untyped-call]
        if not isinstance(client, Client):
            raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}")
        check_client_open(client, type(strategy).__name__)
        known = scheduler_workers(client)
        ps, workers = _match_workers(ps, known), _match_workers(workers, known)
        self.strategy = strategy
        self._client = client
        self._owns_client = False
        self._cluster = None
        self._closed = False
        self._cross_device_ops = None
        self._options = CommunicationOptions()
        self._variables = {}
        self._holders = {}
        self._datasets = weakref.WeakValueDictionary()
        self._variable_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._token = f"daskdist-ps-{uuid.uuid4().hex[:12]}"
        self._partitioner = variable_partitioner
        self.cluster_resolver = cluster_resolver
        self.ps_addresses = list(ps)
        self._worker_groups: dict[str, ReplicaGroup] = {}
        registry.register(self._token, self)
        try:
            self._open_stores(ps, [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(len(ps))])
            hosts = client.run(describe_worker, workers=workers)
            for address in workers:
                self._worker_groups[address] = self._launch_worker(address, hosts[address]["host"])
        except BaseException:
            self.close()
            raise
        logger.info("ParameterServerStrategy: ps %s, workers %s", ps, workers)

    def add_worker(self, address: str) -> None:
        """Start a worker group on a Dask worker that joined the cluster (the coordinator admits it)."""
        self.check_open()
        host = self.client.run(describe_worker, workers=[address])[address]["host"]
        group = self._launch_worker(address, host)
        with self._lock:
            self._worker_groups[address] = group

    _closure_part_handlers: dict[str, Callable[[Any], None]] | None = None

    def on_closure_commit(self, key: str, handler: Callable[[Any], None]) -> None:
        """Call ``handler(part)`` with a closure's part ``key`` when the coordinator commits the closure.

        A part is what an object the closure's function brought with it
        returned when the closure ended on its worker (``at_closure_end`` in
        ``daskdist.ps.closures``: a framework adapter's metric, say). Only
        the run the coordinator keeps commits: a run lost with its worker
        never does, so a re-run closure counts once. Called in the
        coordinator's driver threads, before the closure's ``RemoteValue`` is
        ready (one closure at a time per worker; handlers of several workers
        may run at once). One handler per ``key``: a second replaces the first.
        """
        if self._closure_part_handlers is None:
            self._closure_part_handlers = {}
        self._closure_part_handlers[key] = handler

    def commit_closure(self, parts: dict[str, Any]) -> None:
        """Hand a committed closure's parts to their handlers (``on_closure_commit``); a part without one is dropped."""
        handlers = self._closure_part_handlers or {}
        for key, part in parts.items():
            handler = handlers.get(key)
            if handler is None:
                logger.debug("No handler for closure part %s: dropped", key)
                continue
            handler(part)

    def _launch_worker(self, address: str, host: str) -> ReplicaGroup:
        """A one-replica group on ``address``: the long-lived process that runs this worker's closures."""
        placement = Placement(0, address, host, DeviceSpec("CPU", 0))
        group = ReplicaGroup(
            self.client, [placement], run_replica, strategy_token=self._token, hosts=[host],
            algorithm=CrossDeviceOps().algorithm([placement.device]), options=self._options,
            transport=config.get("collective.transport"),
            shm_slot_bytes=parse_bytes(config.get("collective.shm.slot-bytes")),
            pin_cores=False, malloc=config.get("replica.malloc"),
        )
        group.launch()
        from daskdist.strategy.extended import replica_commands

        group.call(replica_commands.install_resident, (*PS_STRATEGY_KEY, self._token))
        return group

    # -- what the contract describes -----------------------------------------------------

    @property
    def token(self) -> str:
        return self._token

    @property
    def num_replicas(self) -> int:
        """Replicas in sync: one per worker (each worker's step is its own; workers are asynchronous)."""
        return 1

    @property
    def worker_addresses(self) -> tuple[str, ...]:
        return tuple(self._worker_groups)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return tuple(f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(len(self._worker_groups)))

    @property
    def worker_groups(self) -> dict[str, ReplicaGroup]:
        """Worker address -> its one-replica group (the coordinator's transport to it)."""
        return dict(self._worker_groups)

    @property
    def group(self) -> Any:
        raise AttributeError("ParameterServerStrategy has one group per worker (worker_groups), not one group")

    def check_open(self) -> None:
        if self._closed:
            raise StrategyClosedError("This strategy is closed; create a new one")

    # -- running: closures go through the coordinator ----------------------------------------

    def _call_for_each_replica(self, fn: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        """On the client (TF's coordinator) ``run`` calls ``fn`` here as one replica, with TF's warning.

        On workers, ``run`` inside a scheduled function enters the worker's replica.
        """
        logger.warning(RUN_WITHOUT_SCHEDULE)
        frame = context.Frame(strategy=self.strategy, replica_context=cast(Any, OneReplicaContext(self.strategy)),
                              variable_creator=None)
        with context.enter(frame):
            return fn(*args, **kwargs)

    def _run_on(self, command: Command, args: Args | list[Args], ranks: list[int] | None) -> list[Any]:
        addresses = list(self._worker_groups)
        chosen = range(len(addresses)) if ranks is None else ranks
        results = []
        for index in chosen:
            worker_args = args[index] if isinstance(args, list) else args
            results.append(self._worker_groups[addresses[index]].call(command, tuple(worker_args))[0])
        return results

    @property
    def schedules_closures(self) -> bool:
        """``fit``/``evaluate`` run as coordinator closures (the step driver's ``PsStepDriver``), not replica commands."""
        return True

    def step_driver(self, key: str | None = None) -> StepDriver:
        """A closure's steps: pull, compute, push to the stores (``training_contract.PsStepDriver``)."""
        self.check_open()
        return PsStepDriver(self.stores, key or uuid.uuid4().hex)

    def install_resident(self, kind: str, object_id: str, obj: Any) -> None:
        """Models are installed on each worker with their ``PsStepDriver`` (by the adapter), never as SPMD copies."""
        if kind == "model":
            raise NotImplementedError(
                "a model under ParameterServerStrategy trains through its step driver (its parameters on the ps, "
                "each worker its own copy, installed by ClusterCoordinator.run_on_each_worker), not installed on "
                "the workers as a replica copy"
            )
        super().install_resident(kind, object_id, obj)

    def _install_views(self, var_id: str, spec: VariableSpec, store: StoreRef, device: str) -> None:
        """Workers make their views of a variable when a closure first unpickles it."""

    def step_timings(self, last: int | None = None) -> list[list[Kwargs]]:
        from daskdist.replica import commands

        return [g.call(commands.step_timings, (last,))[0] for g in list(self._worker_groups.values())]

    def distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """A dataset each worker reads whole: pass it to ``ClusterCoordinator.create_per_worker_dataset``."""
        return DatasetForEachWorker(dataset=dataset)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any:
        """``dataset_fn`` for each worker: pass the result to ``ClusterCoordinator.create_per_worker_dataset``."""
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        return DatasetForEachWorker(dataset_fn=dataset_fn)

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        coordinator = getattr(self.strategy, "_coordinator", None)
        if coordinator is not None:
            coordinator.shutdown()
        self.close_stores()
        self._closed = True
        registry.unregister(self._token)
        for group in list(self._worker_groups.values()):  # a coordinator thread may admit a worker meanwhile
            try:
                group.close()
            except Exception as e:  # noqa: BLE001 - a lost worker
                logger.debug("Closing worker group %s: %s", group.group_id, e)
        self._variables.clear()


class DatasetForEachWorker:
    """A distributed dataset of ``ParameterServerStrategy`` made on the coordinator (TF's, from the client).

    Workers are asynchronous, each with one replica in sync: each worker
    builds it for itself when it is given to
    ``ClusterCoordinator.create_per_worker_dataset`` (``dataset_fn`` with
    TF's worker input context: one pipeline, id 0, one replica), and its
    batches are not split. Iterating it on the client raises ``ValueError``,
    as in TensorFlow.
    """

    def __init__(self, dataset_fn: Callable[[Any], Any] | None = None, dataset: Any = None):
        self._dataset_fn = dataset_fn
        self._dataset = dataset

    def build_on_worker(self) -> Any:
        """The dataset on this worker (``create_per_worker_dataset`` calls it on each worker)."""
        if self._dataset_fn is None:
            return self._dataset
        from daskdist.data.options import InputContext

        return self._dataset_fn(InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1))

    def __iter__(self) -> Any:
        raise ValueError("a ParameterServerStrategy distributed dataset is not iterated on the coordinator: pass it to "
                         "ClusterCoordinator.create_per_worker_dataset and iterate that (TF's rule)")

    def __repr__(self) -> str:
        what = "dataset_fn" if self._dataset_fn is not None else "a dataset"
        return f"<ParameterServerStrategy distributed dataset from {what}: for create_per_worker_dataset>"


