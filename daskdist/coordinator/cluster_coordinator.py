"""``ClusterCoordinator``: schedule functions on parameter-server workers (TF's ``tf.distribute.coordinator``).

Closures queue on the client; one driver thread per worker takes the next
closure whenever its worker is free (at most one in flight per worker) and
sends it to the worker's one-replica group as a command, never as a Dask
task. Delivery is at-least-once: a closure whose worker is lost goes back to
the front of the queue for another worker. Its updates reach the stores keyed
by (closure id, n), so a closure run again never applies an update twice.

Errors follow TensorFlow (``cluster_coordinator.py``): a closure's own
exception is raised by the next ``schedule``/``join``/``done`` (once, then
cleared), after the in-flight closures finished; queued closures are
cancelled (their ``fetch`` raises ``CancelledError``). A lost parameter
server is fatal: every later call raises ``ParameterServerLostError`` within
about a second, and nothing waits for it.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import optree

from daskdist.cluster.identity import scheduler_workers
from daskdist.exceptions import ParameterServerLostError, ReplicaLostError, StrategyClosedError
from daskdist.group.announcements import announcements_of
from daskdist.group.scheduler_plugin import EVENT_TOPIC
from daskdist.ps.client import (
    ClosureDataLedger,
    PerWorkerIterator,
    PerWorkerValues,
    WorkerResource,
    make_dataset,
    make_iterator,
    plan_by_locality,
    run_recorded_closure,
)
from daskdist.strategy.extended.parameter_server import DatasetForEachWorker, ParameterServerExtended
from daskdist.strategy.parameter_server import ParameterServerStrategy

__all__ = [
    "ClusterCoordinator",
    "ParameterServerLostError",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
]

logger = logging.getLogger(__name__)

#: The coordinator's watch wakes at the scheduler plugin's announcements (a group failed, a worker joined or
#: left); it also looks every this many seconds, in case an announcement was missed.
_WATCH_RECHECK_SECONDS = 2.0


class RemoteValueStatus(enum.Enum):
    """The state of a ``RemoteValue`` (TF's)."""

    NOT_READY = "NOT_READY"
    ABORTED = "ABORTED"
    READY = "READY"


class RemoteValue:
    """The result of a scheduled function, available once it ran (TF's ``RemoteValue``)."""

    def __init__(self, closure_id: str):
        self._closure_id = closure_id
        self._status = RemoteValueStatus.NOT_READY
        self._value: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()

    def _set_value(self, value: Any) -> None:
        self._value, self._status = value, RemoteValueStatus.READY
        self._ready.set()

    def _set_error(self, error: BaseException) -> None:
        self._error, self._status = error, RemoteValueStatus.READY
        self._ready.set()

    def _set_aborted(self) -> None:
        self._status = RemoteValueStatus.ABORTED

    def _set_not_ready(self) -> None:
        if not self._ready.is_set():
            self._status = RemoteValueStatus.NOT_READY

    def _wait(self) -> None:
        while not self._ready.wait(0.1):
            pass

    def fetch(self) -> Any:
        """Wait for the value and return it as numpy (a structure: each array as numpy).

        Raises
        ------
        CancelledError
            The closure was cancelled (another closure failed, or the
            coordinator stopped) or aborted for good.
        Exception
            The closure's own error.
        """
        self._wait()
        if self._error is not None:
            raise self._error
        return optree.tree_map(_to_numpy, self._value, none_is_leaf=True)

    def get(self) -> Any:
        """Wait for the value and return it as it came back (TF's ``get``)."""
        self._wait()
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        return f"<RemoteValue {self._closure_id} {self._status.name}>"


def _to_numpy(x: Any) -> Any:
    return np.asarray(x) if hasattr(x, "__array__") and not isinstance(x, np.ndarray) else x


class _Closure:
    def __init__(self, closure_id: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.closure_id = closure_id
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.remote_value = RemoteValue(closure_id)
        self.attempts = 0


class ClusterCoordinator:
    """Schedules functions on the workers of a ``ParameterServerStrategy`` (TF's ``ClusterCoordinator``).

    One coordinator per strategy: constructing a second returns the first.

    Parameters
    ----------
    strategy
        A ``dd.ParameterServerStrategy``.
    """

    def __new__(cls, strategy: Any) -> ClusterCoordinator:  # noqa: PYI034 - one coordinator per strategy
        existing: ClusterCoordinator | None = getattr(strategy, "_coordinator", None)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: Any):
        if getattr(self, "_strategy", None) is not None:
            return
        if not isinstance(strategy, ParameterServerStrategy):
            raise ValueError(  # noqa: TRY004 - TF's error
                "Only `tf.distribute.experimental.ParameterServerStrategy` is supported to work with "
                "`tf.distribute.experimental.coordinator.ClusterCoordinator` currently."
            )
        strategy.extended.check_open()
        self._strategy = strategy
        extended = strategy.extended
        assert isinstance(extended, ParameterServerExtended)
        self._extended: ParameterServerExtended = extended
        self._queue: collections.deque[_Closure] = collections.deque()
        self._cond = threading.Condition()
        self._inflight = 0
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._stopped = False
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]
        self._workers = list(self._extended.worker_groups)
        self._live: set[str] = set(self._workers)
        self._seen = set(scheduler_workers(self._extended.client))  # newcomers come later
        self._resources: list[tuple[Callable[..., Any], Callable[[int], tuple[Any, ...]]]] = []  # re-made on newcomers
        #: The partitions of Dask collections each committed closure's per-worker pipeline loaded.
        self.data_ledger = ClosureDataLedger()
        self._threads = [threading.Thread(target=self._drive, args=(address,), daemon=True,
                                          name=f"daskdist-coordinator-{i}") for i, address in enumerate(self._workers)]
        self._threads.append(threading.Thread(target=self._watch_cluster, daemon=True,
                                              name="daskdist-coordinator-watch"))
        strategy._coordinator = self
        for thread in self._threads:
            thread.start()

    @property
    def strategy(self) -> Any:
        return self._strategy

    # -- scheduling ------------------------------------------------------------------------

    def schedule(self, fn: Callable[..., Any], args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for whichever worker is free; returns its ``RemoteValue`` at once.

        ``PerWorkerValues`` arguments are replaced by the element of the worker
        that runs it; a ``RemoteValue`` argument raises ``ValueError``. Raises
        the first error of an earlier closure (once), or the fatal error of a
        lost parameter server.
        """
        if not callable(fn):
            raise TypeError(f"schedule needs a function, got {type(fn).__name__}")
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        structure: Any = (args, kwargs)
        leaves: list[Any] = optree.tree_leaves(structure, is_leaf=lambda x: isinstance(x, (RemoteValue, PerWorkerValues)),
                                    none_is_leaf=True)
        if any(isinstance(leaf, RemoteValue) for leaf in leaves):
            raise ValueError("Remote values cannot be passed as arguments to scheduled functions; fetch them first")
        self._raise_if_failed()
        self._extended.place_residents()  # what the function may capture (a framework adapter's models) on the workers
        closure = _Closure(f"{self._prefix}-{next(self._ids)}", fn, args, kwargs)
        with self._cond:
            self._queue.append(closure)
            self._cond.notify_all()
        return closure.remote_value

    def join(self) -> None:
        """Wait until every scheduled function finished; raise the first closure error (once), if any."""
        with self._cond:
            while (self._queue or self._inflight) and self._fatal is None and self._error is None:
                if not self._live:
                    self._fatal = ReplicaLostError("every worker of the ParameterServerStrategy is lost")
                    self._cancel_queued(self._fatal)
                    break
                self._cond.wait(0.2)
        self._raise_if_failed()

    def done(self) -> bool:
        """Whether every scheduled function finished (raises a pending closure error, as ``join``)."""
        self._raise_if_failed()
        with self._cond:
            return not self._queue and not self._inflight

    def fetch(self, val: Any) -> Any:
        """``RemoteValue.fetch()`` on every ``RemoteValue`` in ``val``; other leaves as they are."""
        return optree.tree_map(lambda x: x.fetch() if isinstance(x, RemoteValue) else x, val,
                               is_leaf=lambda x: isinstance(x, RemoteValue), none_is_leaf=True)

    def _raise_if_failed(self) -> None:
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            if self._error is None:
                return
            while self._inflight and self._fatal is None:  # nothing is still executing when it raises
                self._cond.wait(0.2)
            error, self._error = self._error, None
        raise error

    # -- per-worker input ------------------------------------------------------------------------

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """Build a dataset on every worker: ``dataset_fn(input_context)`` (or ``dataset_fn()``), or a dataset."""
        return PerWorkerDataset(self, dataset_fn)

    def run_on_each_worker(self, command: Callable[..., Any], args_for: Callable[[int], tuple[Any, ...]]) -> None:
        """Make a per-worker resource on every live worker, and later on every newcomer.

        ``command`` runs as a replica command of each worker's group with
        ``args_for(index)`` (``index``: the worker's position in ``workers``);
        a worker admitted later runs it too, before it takes closures. If it
        raises on a worker, the error is raised here and newcomers do not run it.
        """
        resource = (command, args_for)
        self._resources.append(resource)
        try:
            for index, address in enumerate(self.workers):
                if self.is_live(address):
                    self._extended.worker_groups[address].call(command, args_for(index))
        except BaseException:
            self._resources.remove(resource)  # a newcomer must not run what failed here
            raise

    @property
    def workers(self) -> tuple[str, ...]:
        """Every worker admitted so far, in index order (a lost one keeps its index)."""
        with self._cond:
            return tuple(self._workers)

    def is_live(self, address: str) -> bool:
        """Whether the worker at ``address`` is admitted and not lost."""
        with self._cond:
            return address in self._live

    @property
    def live_workers(self) -> tuple[str, ...]:
        """The admitted workers not lost, in index order."""
        with self._cond:
            return tuple(a for a in self._workers if a in self._live)

    # -- the drivers -------------------------------------------------------------------------------

    def _take(self) -> _Closure | None:
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait(0.5)
            if self._stopped:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def _drive(self, address: str) -> None:
        group = self._extended.worker_groups[address]
        while True:
            closure = self._take()
            if closure is None:
                return
            closure.attempts += 1
            closure.remote_value._set_not_ready()
            try:
                args, kwargs = _for_worker(closure.args, closure.kwargs, self._workers.index(address))
                result, consumed, parts = group.call(run_recorded_closure, (
                    closure.closure_id, closure.fn, args, kwargs, self._extended.client_writes))[0]
                self._extended.commit_closure(parts)  # the run kept: what its function's objects counted
            except BaseException as e:  # noqa: BLE001 - sorted below: lost worker, lost ps, the closure's own
                if self._worker_lost(e, address):
                    logger.warning("Worker %s was lost running closure %s; it goes to another worker: %s",
                                   address, closure.closure_id, e)
                    closure.remote_value._set_aborted()
                    with self._cond:
                        self._inflight -= 1
                        self._live.discard(address)
                        self._seen.discard(address)  # if it comes back at this address, it is admitted again
                        if self._fatal is None and self._error is None:
                            self._queue.appendleft(closure)  # at least once
                        else:
                            closure.remote_value._set_error(CancelledError(f"closure {closure.closure_id} cancelled"))
                        self._cond.notify_all()
                    return
                self._closure_failed(closure, e)
            else:
                self.data_ledger.record(closure.closure_id, address, consumed)
                closure.remote_value._set_value(result)
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

    def _worker_lost(self, error: BaseException, address: str) -> bool:
        if isinstance(error, StrategyClosedError):
            return not self._stopped
        return isinstance(error, ReplicaLostError) and getattr(error, "worker", None) == address

    def _closure_failed(self, closure: _Closure, error: BaseException) -> None:
        ps_lost = isinstance(error, ReplicaLostError) and getattr(error, "worker", None) in self._extended.ps_addresses
        with self._cond:
            self._inflight -= 1
            if ps_lost and self._fatal is None:
                self._fatal = ParameterServerLostError(f"a parameter server is lost: {error}",
                                                       worker=getattr(error, "worker", None))
                self._fatal.__cause__ = error
            closure.remote_value._set_error(self._fatal if ps_lost and self._fatal is not None else error)
            if self._error is None and self._fatal is None:
                self._error = error
            self._cancel_queued(CancelledError("cancelled: an earlier scheduled function failed"))
            self._cond.notify_all()

    def _cancel_queued(self, error: BaseException) -> None:
        while self._queue:
            self._queue.popleft().remote_value._set_error(error)

    def _watch_cluster(self) -> None:
        """At each change the scheduler announces: fail fast if the store group failed (a ps was lost); admit new workers.

        The stores are members with role ``ps`` of the strategy's store group:
        the scheduler plugin fails that group as soon as a ps's worker leaves
        the cluster (``remove_worker``), and its status says why. A Dask
        worker that joined the cluster after the coordinator started becomes
        a worker: its per-worker datasets and iterators are made on it (TF's
        resource closures) and it takes closures from the queue.
        """
        client = self._extended.client
        group = self._extended.store_group
        announcements = announcements_of(client, EVENT_TOPIC)
        seen = announcements.version
        while not self._stopped:
            seen = announcements.wait_past(seen, _WATCH_RECHECK_SECONDS)
            try:
                status, reason = group.status() if group is not None else ("running", "")
                workers = scheduler_workers(client)
            except Exception as e:  # noqa: BLE001 - the client is closing
                logger.debug("Coordinator could not ask the scheduler for workers: %s", e)
                continue
            if status == "failed" and not self._stopped:
                lost = next((a for a in self._extended.ps_addresses if a not in workers), None)
                with self._cond:
                    if self._fatal is None:
                        self._fatal = ParameterServerLostError(
                            f"a parameter server is lost; training cannot continue (restart from a checkpoint "
                            f"with a new strategy): {reason}", worker=lost)
                    self._cancel_queued(CancelledError(f"cancelled: parameter server {lost} is lost"))
                    self._cond.notify_all()
                return
            with self._cond:
                self._live &= set(workers)
            for address in [a for a in workers if a not in self._seen]:
                self._seen.add(address)
                self._admit(address)

    def _admit(self, address: str) -> None:
        try:
            self._extended.add_worker(address)
            index = self._workers.index(address) if address in self._workers else len(self._workers)
            for command, args_for in self._resources:
                self._extended.worker_groups[address].call(command, args_for(index))
        except Exception as e:  # noqa: BLE001 - a newcomer that fails to start is left out, not fatal
            logger.warning("Could not admit new worker %s: %s", address, e)
            return
        with self._cond:
            if address not in self._workers:
                self._workers.append(address)
            self._live.add(address)
        thread = threading.Thread(target=self._drive, args=(address,), daemon=True,
                                  name=f"daskdist-coordinator-{index}")
        self._threads.append(thread)
        thread.start()
        logger.info("Worker %s joined the ParameterServerStrategy", address)

    def shutdown(self) -> None:
        """Stop the drivers (the strategy closes); queued closures are cancelled."""
        with self._cond:
            self._stopped = True
            self._cancel_queued(CancelledError("cancelled: the strategy was closed"))
            self._cond.notify_all()


def _for_worker(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> Any:
    structure: Any = (args, kwargs)
    return optree.tree_map(lambda x: _element(x, index) if isinstance(x, PerWorkerValues) else x, structure,
                           is_leaf=lambda x: isinstance(x, PerWorkerValues), none_is_leaf=True)


def _element(values: PerWorkerValues, index: int) -> Any:
    if isinstance(values, PerWorkerIterator):  # the same resource key on every worker, newcomers included
        return values.values[0]
    if index >= len(values.values):
        raise ValueError(f"these PerWorkerValues have {len(values.values)} elements; worker {index} joined later")
    return values.values[index]


class PerWorkerDataset:
    """A dataset built on every worker (TF's ``PerWorkerDataset``); ``iter()`` gives per-worker iterators.

    A ``dataset_fn`` whose pipelines read Dask collections and start with
    ``shard(num_input_pipelines, input_pipeline_id)`` is planned by locality
    on the client (``daskdist.ps.input``): ``locality`` is then the plan (each
    worker's partitions), and ``coordinator.data_ledger`` records what each
    committed closure loaded. Otherwise ``dataset_fn`` runs on each worker.
    """

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Any):
        if isinstance(dataset_fn, DatasetForEachWorker):  # made by the strategy on the coordinator
            dataset_fn = dataset_fn.build_on_worker
        self._coordinator = coordinator
        self._key = f"ps-dataset:{uuid.uuid4().hex[:12]}"
        live = list(coordinator.live_workers)
        if not live:  # nothing to build it on (the planning below needs one worker at least)
            raise ReplicaLostError("every worker of the ParameterServerStrategy is lost: no worker to build a "
                                   "per-worker dataset on")
        self.locality = plan_by_locality(coordinator.strategy.extended.client, live, dataset_fn, self._key)
        if self.locality is not None:
            plan, count = self.locality, len(live)
            by_address = dict(zip(live, plan.datasets))
            indices = coordinator.workers
            readers = {j: indices.index(a) for j, a in enumerate(live)}  # pipeline -> its worker's index

            def planned(i: int) -> tuple[Any, ...]:
                """Worker ``i``'s pipeline; a newcomer takes over a lost worker's (else reads ``i mod count`` again)."""
                workers = coordinator.workers
                address = workers[i] if i < len(workers) else None
                dataset = by_address.get(address) if address is not None else None
                if address is not None and dataset is not None:
                    return (self._key, dataset, live.index(address), count)
                orphaned = [j for j, reader in sorted(readers.items())
                            if reader != i and (reader >= len(workers) or not coordinator.is_live(workers[reader]))]
                if orphaned:
                    readers[orphaned[0]] = i
                    dataset = plan.takeover(orphaned[0], coordinator.data_ledger.load_counts(self._key))
                    return (self._key, dataset, orphaned[0], count)
                return (self._key, plan.portable[i % count], i % count, count)

            coordinator.run_on_each_worker(make_dataset, planned)
            return
        workers = len(coordinator.workers)  # a newcomer reads input pipeline (its index mod this)
        coordinator.run_on_each_worker(make_dataset, lambda i: (self._key, dataset_fn, i % workers, workers))

    def __iter__(self) -> PerWorkerValues:
        key = f"ps-iterator:{uuid.uuid4().hex[:12]}"
        self._coordinator.run_on_each_worker(make_iterator, lambda i: (self._key, key))
        return PerWorkerIterator(tuple(WorkerResource(key) for _ in self._coordinator.workers))
