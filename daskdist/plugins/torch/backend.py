"""``init_process_group`` inside a replica: torch.distributed's default group on the ``daskdist`` backend.

``init_process_group()`` (called in a function that ``strategy.run`` runs on
the replicas) registers the ``daskdist`` backend with
``torch.distributed.Backend.register_backend``, and initialises torch's
default group with rank = the replica's id in sync and world size = the
replicas in sync, meeting through ``DaskdistStore`` (the scheduler: no
``MASTER_ADDR``, no port). The group belongs to one membership generation:
called again after the group re-formed (elastic), it destroys the old one and
builds the next. While it lives, the process holds the environment torchrun
would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...: ``environment``),
so Hugging Face's ``Trainer``, ``accelerate`` and ``DistributedSampler`` see
the group; its destruction puts the variables back. It is destroyed when its replica closes (the strategy
closed, or the worker left the group: a close callback of the replica
runtime, ``add_close_callback``), or by ``destroy_process_group()``.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from typing import Any

import torch.distributed as dist

from daskdist import config, context
from daskdist.plugins.torch import environment
from daskdist.plugins.torch.comm import ReplicaComm, comm_thread_wanted
from daskdist.plugins.torch.process_group import BACKEND_NAME, ProcessGroupDaskdist
from daskdist.plugins.torch.store import DaskdistStore

__all__ = ["attach", "destroy_process_group", "init_process_group", "is_current", "register_backend"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_registered = False


class _Current:
    """What this process's default group is made of (one replica per process holds it)."""

    comm: ReplicaComm | None = None
    runtime: Any = None
    generation: int = -1
    store: DaskdistStore | None = None


_current = _Current()


def register_backend() -> None:
    """Register ``"daskdist"`` with ``torch.distributed`` (idempotent; devices: cpu, and cuda through NCCL)."""
    global _registered
    with _lock:
        if _registered or BACKEND_NAME.upper() in dist.Backend._plugins:
            _registered = True
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def _create(options: Any, backend_options: Any) -> ProcessGroupDaskdist:
    """torch's creator: the default group, or a subgroup of it (``new_group``) with its global ranks."""
    comm = _current.comm
    if comm is None:
        raise RuntimeError("the daskdist torch backend is made by dd.plugins.torch.init_process_group(), "
                           "inside a function run on the replicas (strategy.run)")
    if int(options.group_size) != comm.runtime.size:  # torch asks the default group for subgroups (new_group)
        raise RuntimeError("daskdist subgroups come from the default group's new_group; this torch did not ask it")
    pg = ProcessGroupDaskdist(comm, int(options.group_rank), int(options.group_size))
    pg._store = options.store
    return pg


def init_process_group(timeout: datetime.timedelta | float | None = None) -> None:
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
        torch's timeout of the group (seconds or a ``timedelta``); daskdist's
        collectives keep their own deadline (``daskdist.collective.timeout``).

    Raises
    ------
    RuntimeError
        Outside a replica; called twice in one generation; several replicas
        share this process (threaded workers: one replica per worker process
        is needed); or ``torch.distributed`` was initialised by something else.
    """
    runtime = context.current_runtime()
    if runtime is None or not hasattr(runtime, "communicator") or not hasattr(runtime, "worker"):
        raise RuntimeError("dd.plugins.torch.init_process_group() must be called inside a function run on the "
                           "replicas (strategy.run(fn)), not on the client or outside a strategy")
    if dist.is_initialized():
        if _current.comm is None:
            raise RuntimeError(f"torch.distributed is already initialised in this process (backend "
                               f"{dist.get_backend()!r}) by something other than daskdist")
        if _current.runtime is runtime and _current.generation == runtime.generation:
            raise RuntimeError("dd.plugins.torch.init_process_group() was already called in this replica (for "
                               f"generation {runtime.generation} of {runtime.group_id}); call it once")
        destroy_process_group()  # a closed strategy's group, or the previous generation's
    register_backend()
    comm = ReplicaComm(runtime, threaded=comm_thread_wanted(config.get("torch.comm-thread", "auto")))
    try:
        where = comm.call(lambda group, _: group.all_gather_objects((socket.gethostname(), os.getpid())))
        shared = sorted({r for r, w in enumerate(where) if where.count(w) > 1})
        if shared:
            raise RuntimeError(
                f"the daskdist torch backend needs one replica per worker process: replicas {shared} share one "
                "process (a threaded cluster, e.g. LocalCluster(processes=False), or workers with several "
                "threads holding replicas); torch.distributed's default group is process-global")
        store = DaskdistStore(runtime.worker, f"{runtime.group_id}/{runtime.generation}")
        _current.comm, _current.runtime, _current.generation, _current.store = comm, runtime, runtime.generation, store
        if timeout is None:
            timeout = datetime.timedelta(seconds=config.get_seconds("collective.timeout"))
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        dist.init_process_group(BACKEND_NAME, store=store, rank=int(runtime.rank), world_size=int(runtime.size),
                                timeout=timeout)
        members = runtime.membership
        environment.export(environment.torchrun_environment(int(runtime.rank), members.hosts, members.addresses))
        # the replica's close destroys the group it made (a callback per generation: one call each, few)
        runtime.add_close_callback(lambda: _destroy_if_made_by(runtime))
    except BaseException:
        comm.close()
        _current.comm = _current.runtime = _current.store = None
        _current.generation = -1
        raise
    logger.info("torch.distributed initialised on daskdist: rank %d of %d (%s, generation %d, %s)", runtime.rank,
                runtime.size, runtime.group_id, runtime.generation,
                "communication thread" if comm.threaded else "inline")


def attach(runtime: Any) -> None:
    """Let torch's own ``init_process_group("daskdist", ...)`` make the group of ``runtime``'s generation.

    For scripts that initialise ``torch.distributed`` themselves (``python -m
    daskdist.torchrun``): the backend is registered and its communicator made,
    so torch's creator finds them; torch's rendezvous store (``env://``) is the
    group's store. The replica's close destroys what torch made.
    """
    register_backend()
    comm = ReplicaComm(runtime, threaded=comm_thread_wanted(config.get("torch.comm-thread", "auto")))
    _current.comm, _current.runtime, _current.generation, _current.store = comm, runtime, runtime.generation, None
    runtime.add_close_callback(lambda: _destroy_if_made_by(runtime))


def is_current(runtime: Any = None) -> bool:
    """Whether this process's default group was made by ``init_process_group`` for ``runtime``'s generation.

    ``runtime``: a replica runtime (default: the one whose function runs in this thread).
    """
    runtime = context.current_runtime() if runtime is None else runtime
    return (runtime is not None and _current.comm is not None and _current.runtime is runtime
            and _current.generation == runtime.generation and dist.is_initialized())


def _destroy_if_made_by(runtime: Any) -> None:
    """The replica ``runtime`` closes: destroy the default group if that replica made it (not a later one's)."""
    if _current.runtime is runtime:
        logger.debug("Replica %s closes: destroying its torch process group", runtime.rank)
        destroy_process_group()


def destroy_process_group() -> None:
    """Destroy the default group made by ``init_process_group`` (and its subgroups), if there is one."""
    comm = _current.comm
    if comm is None:
        return
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        comm.close()
        environment.restore()
        _current.comm = _current.runtime = _current.store = None
        _current.generation = -1
