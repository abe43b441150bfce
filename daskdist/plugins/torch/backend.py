"""``init_process_group`` inside a replica: torch.distributed's default group on the ``daskdist`` backend.

``init_process_group()`` (called in a function that ``strategy.run`` runs on
the replicas) registers the ``daskdist`` backend with
``torch.distributed.Backend.register_backend``, and initialises torch's
default group with rank = the replica's id in sync and world size = the
replicas in sync, meeting through ``DaskdistStore`` (the scheduler: no
``MASTER_ADDR``, no port). torch's group is a ``ProcessGroupDaskdist`` over
the replica's own ``collective.ProcessGroup`` of that membership generation;
``new_group`` makes one over a subgroup of it (``member_group``, made by the
members), and ``new_group(backend="gloo")`` a gloo group through the same
store. The group belongs to one membership generation: called again in the
same generation, ``init_process_group`` returns it; after the group re-formed
(elastic), it destroys the old one and builds the next. While it lives, the
process holds the environment torchrun would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ...: ``environment``), so Hugging Face's
``Trainer``, ``accelerate`` and ``DistributedSampler`` see the group; its
destruction puts the variables back. It is destroyed when its replica closes
(the strategy closed, or the worker left the group: a close callback of the
replica runtime, ``add_close_callback``), or by ``destroy_process_group()``.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from daskdist import config, context
from daskdist.plugins.torch import environment
from daskdist.plugins.torch.process_group import BACKEND_NAME, ProcessGroupDaskdist
from daskdist.plugins.torch.store import DaskdistStore

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["attach", "comm_thread_wanted", "daskdist_store", "destroy_process_group", "init_process_group",
           "is_current", "register_backend"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_registered = False


class _Current:
    """What this process's default group is made of (one replica per process holds it)."""

    group: ProcessGroupDaskdist | None = None
    runtime: ReplicaService | None = None
    generation: int = -1
    store: DaskdistStore | None = None
    timeout: float | None = None  # the deadline given to init_process_group (None: daskdist's own)
    threaded: bool = False


_current = _Current()


def comm_thread_wanted(setting: Any) -> bool:
    """``daskdist.torch.comm-thread``: ``True``/``False``, or ``auto`` (the thread when this thread may use
    more than one core: on one pinned core the thread only competes with backward)."""
    if isinstance(setting, str) and setting.lower() == "auto":
        try:
            return len(os.sched_getaffinity(0)) > 1
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            return True
    if isinstance(setting, str):
        return setting.lower() in ("true", "yes", "1", "thread")
    return bool(setting)


def register_backend() -> None:
    """Register ``"daskdist"`` with ``torch.distributed`` (idempotent; devices: cpu, and cuda through NCCL)."""
    global _registered
    with _lock:
        if _registered or BACKEND_NAME.upper() in dist.Backend._plugins:
            _registered = True
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"init_process_group's timeout must be positive; got {timeout!r}")
    return seconds


def _create(options: Any, backend_options: Any) -> ProcessGroupDaskdist:
    """torch's creator: the default group (every replica), or a subgroup (``new_group``: its members only)."""
    runtime = _current.runtime
    if runtime is None:
        raise RuntimeError("the daskdist torch backend is made by dd.plugins.torch.init_process_group(), "
                           "inside a function run on the replicas (strategy.run)")
    root = runtime.process_group
    ranks = [int(r) for r in options.global_ranks_in_group]
    if not ranks:
        group = root
    else:  # torch's new_group passes its own default timeout unless given one: the root's holds then
        given = options.timeout if options.timeout != dist.constants.default_pg_timeout else None
        group = root.member_group(ranks, str(options.group_id), timeout=_seconds(given))
    threaded = _current.threaded if not ranks else comm_thread_wanted(config.get("torch.comm-thread", "auto"))
    made = ProcessGroupDaskdist(group, threaded, options.store)
    if not ranks and _current.group is None:  # torch's own init_process_group("daskdist") after attach()
        _current.group = made
    return made


def init_process_group(timeout: datetime.timedelta | float | None = None) -> Any:
    """Initialise ``torch.distributed``'s default group on the ``daskdist`` backend, in this replica.

    Call it inside a function run by ``strategy.run``, on every replica. Then
    ``torch.distributed`` answers ``is_initialized()``, ``get_rank()`` (the
    replica id in sync), ``get_world_size()`` (the replicas in sync) and
    ``get_backend() == "daskdist"``, and ``DistributedDataParallel``,
    ``SyncBatchNorm``, ``ZeroRedundancyOptimizer`` and ``dist.*`` carry their
    tensors over daskdist's collectives.

    Parameters
    ----------
    timeout
        The group's deadline (seconds or a ``timedelta``): a collective that a
        member skips raises on every member within it, naming the member and
        the collective. Default: ``daskdist.collective.timeout``. It is also
        the deadline of the generation's other collectives
        (``ReplicaContext.all_reduce``) while the torch group lives.

    Returns
    -------
    torch.distributed.ProcessGroup
        The default group (``torch.distributed.group.WORLD``). Called again in
        the same replica and generation, it returns the group it made.

    Raises
    ------
    RuntimeError
        Outside a replica; several replicas share this process (threaded
        workers: one replica per worker process is needed); or
        ``torch.distributed`` was initialised by something else.
    ValueError
        Called again in the same generation with another timeout.
    """
    runtime = context.current_runtime()
    if runtime is None or not hasattr(runtime, "communicator") or not hasattr(runtime, "worker"):
        raise RuntimeError("dd.plugins.torch.init_process_group() must be called inside a function run on the "
                           "replicas (strategy.run(fn)), not on the client or outside a strategy")
    seconds = _seconds(timeout)
    if dist.is_initialized():
        if _current.group is None:
            raise RuntimeError(f"torch.distributed is already initialised in this process (backend "
                               f"{dist.get_backend()!r}) by something other than daskdist")
        if is_current(runtime):
            if timeout is not None and seconds != _current.timeout:
                raise ValueError(
                    f"dd.plugins.torch.init_process_group(timeout={seconds:g} s) in a replica whose group (generation "
                    f"{runtime.generation} of {runtime.group_id}) was made with timeout={_current.timeout} s: "
                    "destroy_process_group() first to change it")
            return dist.group.WORLD
        destroy_process_group()  # a closed strategy's group, or the previous generation's
    register_backend()
    root = runtime.process_group
    where = root.all_gather_objects((socket.gethostname(), os.getpid()))
    shared = sorted({r for r, w in enumerate(where) if where.count(w) > 1})
    if shared:
        raise RuntimeError(
            f"the daskdist torch backend needs one replica per worker process: replicas {shared} share one "
            "process (a threaded cluster, e.g. LocalCluster(processes=False), or workers with several "
            "threads holding replicas); torch.distributed's default group is process-global")
    store = DaskdistStore(runtime.worker, f"{runtime.group_id}/{runtime.generation}")
    _current.runtime, _current.generation, _current.store = runtime, runtime.generation, store
    _current.timeout, _current.threaded = seconds, comm_thread_wanted(config.get("torch.comm-thread", "auto"))
    try:
        if seconds is not None:
            root.set_timeout(seconds)
            store.set_timeout(datetime.timedelta(seconds=seconds))
        dist.init_process_group(BACKEND_NAME, store=store, rank=int(runtime.rank), world_size=int(runtime.size),
                                timeout=datetime.timedelta(seconds=root.timeout))
        _current.group = dist.group.WORLD  # the default group torch made through _create
        members = runtime.membership
        environment.export(environment.torchrun_environment(int(runtime.rank), members.hosts, members.addresses))
        # the replica's close destroys the group it made (a callback per generation: one call each, few)
        runtime.add_close_callback(lambda: _destroy_if_made_by(runtime))
    except BaseException:
        _forget()
        raise
    logger.info("torch.distributed initialised on daskdist: rank %d of %d (%s, generation %d, %s, timeout %g s)",
                runtime.rank, runtime.size, runtime.group_id, runtime.generation,
                "communication thread" if _current.threaded else "inline", root.timeout)
    return dist.group.WORLD


def attach(service: ReplicaService) -> None:
    """Let torch's own ``init_process_group("daskdist", ...)`` make the group of ``service``'s generation.

    For scripts that initialise ``torch.distributed`` themselves (``python -m
    daskdist.torchrun``): the backend is registered and bound to the replica,
    so torch's creator finds it; torch's rendezvous store (``env://``) is the
    group's store. The replica's close destroys what torch made.
    """
    register_backend()
    _current.runtime, _current.generation, _current.store = service, service.generation, None
    _current.timeout, _current.threaded = None, comm_thread_wanted(config.get("torch.comm-thread", "auto"))
    service.add_close_callback(lambda: _destroy_if_made_by(service))


def is_current(service: ReplicaService | None = None) -> bool:
    """Whether this process's default group was made by ``init_process_group`` for ``service``'s generation.

    ``service``: a replica service (default: the one whose function runs in this thread).
    """
    service = context.current_runtime() if service is None else service
    return (service is not None and _current.group is not None and _current.generation == service.generation
            and _current.runtime is service and dist.is_initialized())


def daskdist_store() -> DaskdistStore | None:
    """The default group's ``DaskdistStore`` itself (torch's default store is a ``PrefixStore`` over it, which
    cannot ``delete_key`` or ``num_keys``: torch's trampoline for stores written in Python lacks them)."""
    return _current.store if _current.group is not None else None


def _destroy_if_made_by(service: ReplicaService) -> None:
    """The replica ``service`` closes: destroy the default group if that replica made it (not a later one's)."""
    if _current.runtime is service:
        logger.debug("Replica %s closes: destroying its torch process group", service.rank)
        destroy_process_group()


def _forget() -> None:
    """Drop what the default group was made of; the root group's deadline goes back to daskdist's own."""
    group, runtime = _current.group, _current.runtime
    if group is not None and _current.timeout is not None and not group.daskdist_group.closed:
        group.daskdist_group.set_timeout(None)
    elif group is None and runtime is not None and _current.timeout is not None:
        runtime.process_group.set_timeout(None)
    _current.group = _current.runtime = _current.store = None
    _current.generation = -1
    _current.timeout = None
    environment.restore()


def destroy_process_group() -> None:
    """Destroy the default group made by ``init_process_group`` (and its subgroups), if there is one.

    torch shuts each group down first (its work issued so far finishes). After
    ``attach`` (a torchrun script in the replica), whatever default group the
    script made (``"daskdist"``, ``"gloo"``) is destroyed.
    """
    if _current.group is None and _current.runtime is None:
        return
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _forget()
