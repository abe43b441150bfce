"""The worker half of ``ClusterCoordinator``: closures and per-worker resources, run on a worker's replica.

The client's queue and drivers (``daskdist.coordinator.cluster_coordinator``) send these
functions as commands to each worker's one-replica group. A closure's reads
and updates are batched per store (``daskdist.ps.session``); per-worker
datasets and iterators are residents of the worker's replica, named by a
``WorkerResource`` the client passes in a closure's arguments.

An object a closure's function brought with it (a framework adapter's
reference, resolved as the function is unpickled) may ask to be called when
the closure returns (``at_closure_end``): what it returns travels back with
the closure's result as the closure's *part* ``key``, which the client hands
to the handler registered under ``key`` only for the run of the closure that
it keeps (``ParameterServerExtended.on_closure_commit``): a run lost with its
worker commits nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import optree

from daskdist import context
from daskdist.group.service import DATASET, ITERATOR, STRATEGY, ReplicaService
from daskdist.ps.input import drain_consumed
from daskdist.ps.session import begin_closure, end_closure

__all__ = [
    "ClosureEnds",
    "PerWorkerIterator",
    "PerWorkerValues",
    "WorkerResource",
    "at_closure_end",
    "make_dataset",
    "make_iterator",
    "run_closure",
    "run_recorded_closure",
]


class PerWorkerValues:
    """One value per worker (TF's ``PerWorkerValues``); a closure receives its own worker's element."""

    def __init__(self, values: tuple[Any, ...]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __repr__(self) -> str:
        return f"PerWorkerValues({list(self._values)!r})"


class PerWorkerIterator(PerWorkerValues):
    """Per-worker iterators: pass to ``schedule``; ``next()`` on it is not supported (as in TF).

    Every element is the same ``WorkerResource`` (one key on every worker,
    newcomers included).
    """

    def __next__(self) -> Any:
        raise TypeError("next() is not supported on per-worker iterators: pass them to coordinator.schedule "
                        "and call next() inside the scheduled function")


class WorkerResource:
    """A reference to an object a worker holds (its dataset, its iterator), resolved on that worker."""

    def __init__(self, key: str):
        self.key = key

    def __repr__(self) -> str:
        return f"<worker resource {self.key}>"


#: The resident under which a worker keeps what to call when its closure returns (``at_closure_end``).
CLOSURE_ENDS_KEY = (STRATEGY, "ps-closure-ends")


class ClosureEnds:
    """The calls ``at_closure_end`` asked for during one command (run id) of a worker: the closure it runs."""

    def __init__(self, run_id: Any):
        self.run_id = run_id
        self.calls: dict[str, Callable[[], Any]] = {}


def at_closure_end(service: ReplicaService, key: str, finish: Callable[[], Any]) -> None:
    """Call ``finish()`` when the closure this worker is unpickling or running returns (not when it raises).

    Made for what a closure's function brings with it (it is unpickled before
    the closure starts, in the same command): ``finish``'s value, unless
    ``None``, goes back with the closure's result as its part ``key``; the
    client commits it (``on_closure_commit``) for the run it keeps only. A
    second call with the same ``key`` in one closure replaces the first.
    """
    ends = service.objects.find(*CLOSURE_ENDS_KEY)
    if not isinstance(ends, ClosureEnds) or ends.run_id != service.run_id:
        ends = ClosureEnds(service.run_id)
        service.objects.install(*CLOSURE_ENDS_KEY, ends)
    ends.calls[key] = finish


def _finish(service: ReplicaService) -> dict[str, Any]:
    """Call what ``at_closure_end`` asked for in this command (calls of an earlier one, which failed, are dropped)."""
    ends = service.objects.find(*CLOSURE_ENDS_KEY)
    if not isinstance(ends, ClosureEnds):
        return {}
    service.objects.discard(*CLOSURE_ENDS_KEY)
    if ends.run_id != service.run_id:
        return {}
    parts = {key: finish() for key, finish in ends.calls.items()}
    return {key: value for key, value in parts.items() if value is not None}


def run_closure(service: ReplicaService, closure_id: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                client_writes: int = 0) -> Any:
    """Worker command: run one closure, its updates keyed by ``closure_id`` (deduplicated at the stores).

    Its reads and updates are batched per store (``daskdist.ps.session``):
    the queued updates are pushed before the closure's result returns.
    ``client_writes``: the client's count of variable writes (values pulled
    ahead at the end of this worker's previous closure are used only if it
    did not change). Parts (``at_closure_end``) are dropped: the v1 facade's
    calls commit none.
    """
    return _run_closure(service, closure_id, fn, args, kwargs, client_writes)[0]


def _run_closure(service: ReplicaService, closure_id: str, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], client_writes: int) -> tuple[Any, dict[str, Any]]:
    """``run_closure``: the closure's result and its parts (``at_closure_end``)."""
    structure: Any = (args, kwargs)
    resolved: Any = optree.tree_map(
        lambda x: service.objects.get(ITERATOR, x.key) if isinstance(x, WorkerResource) else x,
        structure, is_leaf=lambda x: isinstance(x, WorkerResource), none_is_leaf=True)
    args, kwargs = resolved
    session = begin_closure(service, closure_id, client_writes)
    failed = True
    outer = context.current_frame()
    # TF runs a scheduled function in cross-replica context (traced in the strategy's scope): strategy.run
    # enters the worker's replica, strategy.reduce works on what it returns
    scheduled = context.Frame(strategy=service.strategy_view, replica_context=None,
                              variable_creator=outer.variable_creator if outer is not None else None, owner=service)
    try:
        with context.enter(scheduled):
            result = service.run_step(fn, args, kwargs)
        parts = _finish(service)
        failed = False
        return result, parts
    finally:
        if failed:
            service.objects.discard(*CLOSURE_ENDS_KEY)
        end_closure(service, session, failed)


def run_recorded_closure(service: ReplicaService, closure_id: str, fn: Callable[..., Any], args: tuple[Any, ...],
                         kwargs: dict[str, Any], client_writes: int = 0
                         ) -> tuple[Any, list[tuple[str, int, int, int]], dict[str, Any]]:
    """Worker command: ``run_closure``; the partition loads its pipelines made (for the data ledger) and its
    parts (``at_closure_end``), which the client commits when it keeps this run.

    The loads of a closure that raised are dropped: it commits nothing.
    """
    try:
        result, parts = _run_closure(service, closure_id, fn, args, kwargs, client_writes)
    except BaseException:
        drain_consumed(service)
        raise
    return result, drain_consumed(service), parts


def make_dataset(service: ReplicaService, key: str, dataset_fn: Any, index: int, workers: int) -> None:
    """Worker command: build this worker's dataset (input pipeline ``index`` of ``workers``) under ``key``."""
    from daskdist.data import InputContext

    if callable(dataset_fn) and not hasattr(dataset_fn, "__iter__"):
        takes_context = len(inspect.signature(dataset_fn).parameters) >= 1
        ctx = InputContext(num_input_pipelines=workers, input_pipeline_id=index, num_replicas_in_sync=1)
        outer = context.current_frame()
        no_variables = context.Frame(strategy=outer.strategy if outer is not None else None,
                                     replica_context=outer.replica_context if outer is not None else None,
                                     variable_creator=_refuse_variable, owner=service)
        with context.enter(no_variables):
            dataset = dataset_fn(ctx) if takes_context else dataset_fn()
    else:
        dataset = dataset_fn
    bind = getattr(getattr(dataset, "source", None), "bind", None)
    if bind is not None:  # partitions read from this worker's memory, loads logged for the ledger
        bind(service)
    service.objects.install(DATASET, key, dataset)


def _refuse_variable(*args: Any, **kwargs: Any) -> Any:
    """A per-worker dataset function may not create variables (TF's ``PerWorkerDatasetFromDatasetFunction``)."""
    raise ValueError("Creating variables in `dataset_fn` is not allowed.")


def make_iterator(service: ReplicaService, dataset_key: str, key: str) -> None:
    """Worker command: an iterator over this worker's dataset ``dataset_key``, kept under ``key``."""
    service.objects.install(ITERATOR, key, iter(service.objects.get(DATASET, dataset_key)))
