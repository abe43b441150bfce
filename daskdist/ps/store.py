"""The parameter store: variables held in one Dask worker's host memory, served to replicas and the client.

A ``ParameterStore`` lives in ``worker.extensions["daskdist-ps"]`` of each
worker that holds parameters (CentralStorage's parameter holder, the ps
members of ParameterServerStrategy), installed by the worker plugin when the
worker becomes a member with role ``ps`` of a strategy's store group
(``daskdist.ps.members``). It is separate from any replica on
that worker: a replica computing there keeps its own compute copy and reads
the store like the others. Requests arrive through the worker handler
``daskdist_ps`` (Dask comms, worker to worker or client to worker; never
through the scheduler) or, from a replica on the same worker, as direct
calls (``daskdist.ps.refs``: that replica finds the store in its own
worker's extensions; no registry outside the worker).

Every operation runs on the worker's event loop, one at a time, so an update
is atomic and versions are totally ordered. Values are handed out without a
copy, read-only: dense updates put a fresh array in place of the old one, and
in-place changes (scatter, ``apply_fn``) copy first if the value was handed
out (copy-on-write), so a reader in the same process, or a reply Dask
serializes later, always sees the value it was given. Operations:

``create``, ``read``, ``gather``, ``update``, ``scatter``, ``apply_fn`` (TF's
``extended.update``: a function applied once to the stored variable),
``drop``; ``exchange`` (a parameter-server worker's batch: its queued
updates applied in order, then the reads it asks for, version-aware, and
row gathers; ``daskdist.ps.session``); ``requests``, ``bytes_served``,
``staleness``, ``duplicates``, ``versions`` (figures);
``contribute`` (synchronous rounds: each of ``size`` replicas contributes to
round ``r`` of a key; once all have, the round is finished once, e.g. an
aggregated assign or a gradient step with an update rule, and every
contributor gets the same result: the parameter holder's step driver);
``params_state`` / ``params_set`` for the parameters and update-rule state a
trainable keeps here, ``params_drop`` / ``params_keys`` to release and list them; ``params_init``, ``params_pull`` and ``params_push``
for the parameter-server step driver (each worker pushes its gradients on
its own; the update rule runs here). The store knows no framework: a
trainable's parameters are arrays, its update rule an object the adapter
sends (``daskdist.strategy.drivers.contract.UpdateRule``: ``apply``,
``learning_rate``, ``get_state``/``set_state`` of its slots).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed.protocol.serialize import Serialize, ToPickle

from daskdist import serialization
from daskdist.arrays import as_array, namespace, to_numpy
from daskdist.ps.entries import Entry, StoredVariable, apply_method, copy_to_host, hand_out, writable
from daskdist.ps.rounds import SynchronousRounds

if TYPE_CHECKING:
    from distributed import Worker

    from daskdist.variables.distributed import VariableSpec

__all__ = ["HANDLER", "STORE_EXTENSION", "ParameterStore", "unwrap"]

logger = logging.getLogger(__name__)

STORE_EXTENSION = "daskdist-ps"
_DEDUPE_WINDOW = 1 << 16  # update keys remembered per variable
_STALENESS_HISTORY = 1 << 16  # staleness samples kept per store id
HANDLER = "daskdist_ps"
_TRAFFIC_OPS = frozenset({"read", "gather", "update", "scatter", "exchange"})  # counted by ``requests``


@dataclass
class _ParameterSet:
    """A trainable's parameters held here (arrays, in the trainable's order) and the update rule that owns their slots."""

    params: list[Any]
    rule: Any
    version: int = 0


def unwrap(obj: Any) -> Any:
    """The object a Dask ``ToPickle``/``Serialize`` wrapper carries (a comm that did not deserialize it)."""
    if isinstance(obj, (ToPickle, Serialize)):
        return obj.data
    return obj


class ParameterStore:
    """The variables one worker holds for the strategies that placed them here (keyed by store id)."""

    def __init__(self, worker: Worker | None = None):
        self.worker = worker
        self._entries: dict[tuple[str, str], Entry] = {}
        self._params: dict[tuple[str, str], _ParameterSet] = {}
        self._rounds = SynchronousRounds()  # ``contribute``
        self._applied: dict[tuple[str, str], OrderedDict[tuple[Any, ...], None]] = {}  # update keys applied, per variable
        self._duplicates: dict[str, int] = {}
        self._staleness: dict[str, collections.deque[int]] = {}
        self._served: dict[str, int] = {}  # bytes of values sent out, per store id (reads and row gathers)
        self._requests: dict[str, int] = {}  # variable traffic requests served, per store id
        self._lock = threading.RLock()  # the event loop and the direct channel's threads take turns
        self.server: Any = None  # the direct channel (``daskdist.ps.channel.StoreServer``), if any

    def __repr__(self) -> str:
        return f"<ParameterStore variables={len(self._entries)} parameter_sets={len(self._params)}>"

    # -- the handler -----------------------------------------------------------------

    async def handle(self, payload: Any) -> dict[str, Any]:
        """``daskdist_ps`` handler: ``payload`` is ``(op, kwargs)``; never raises across the wire.

        The request and the reply travel as Dask-serialized objects (pickle
        protocol 5: numpy buffers are frames of their own, sent without a
        copy into one pickle); a request from an older client may be a pickled
        ``bytes``.
        """
        try:
            op, kwargs = serialization.loads(payload) if isinstance(payload, bytes) else unwrap(payload)
            result = await self.run(op, kwargs)
            return {"status": "OK", "result": ToPickle(result)}
        except Exception as e:  # noqa: BLE001 - handlers answer with the error, never raise across the wire
            address = self.worker.address if self.worker is not None else ""
            return serialization.error_message(e, -1, address)

    async def run(self, op: str, kwargs: dict[str, Any]) -> Any:
        """Run one operation (on the worker's event loop)."""
        method = self._method(op, kwargs)
        with self._lock:
            result = method(**kwargs)
        if asyncio.iscoroutine(result):
            result = await result  # ``contribute``: takes the lock itself, never across an await
        return result

    def run_sync(self, op: str, kwargs: dict[str, Any]) -> Any:
        """Run one operation from any thread (the direct channel, a replica of this process); ``contribute`` waits there."""
        method = self._method(op, kwargs)
        if op == "contribute":
            return self._contribute_blocking(**kwargs)
        with self._lock:
            result = method(**kwargs)
        if asyncio.iscoroutine(result):
            result.close()
            raise ValueError(f"parameter store operation {op!r} runs on the event loop only")
        return result

    def _method(self, op: str, kwargs: dict[str, Any]) -> Any:
        method = getattr(self, f"_op_{op}", None)
        if method is None:
            raise ValueError(f"unknown parameter store operation {op!r}")
        if op in _TRAFFIC_OPS:
            store_id = kwargs.get("store_id", "")
            with self._lock:
                self._requests[store_id] = self._requests.get(store_id, 0) + 1
        return method

    def close(self) -> None:
        """The worker closes: stop the direct channel."""
        if self.server is not None:
            self.server.close()
            self.server = None

    # -- variables ----------------------------------------------------------------------

    def _entry(self, store_id: str, var_id: str) -> Entry:
        try:
            return self._entries[(store_id, var_id)]
        except KeyError:
            raise KeyError(f"the parameter store holds no variable {var_id!r} of {store_id}") from None

    def _op_create(self, store_id: str, var_id: str, value: Any, spec: VariableSpec) -> int:
        self._entries[(store_id, var_id)] = Entry(copy_to_host(value), spec)
        return 0

    def _op_read(self, store_id: str, var_id: str, newer_than: int = -1) -> tuple[int, Any]:
        """``(version, the value, read-only)``, or ``(version, None)`` if not newer than ``newer_than``."""
        entry = self._entry(store_id, var_id)
        if entry.version <= newer_than:
            return entry.version, None
        self._count(store_id, entry.value.nbytes)
        return entry.version, hand_out(entry)

    def _op_gather(self, store_id: str, var_id: str, indices: Any) -> tuple[int, Any]:
        """``(version, copy of rows indices)``: what an embedding lookup needs, not the whole table."""
        entry = self._entry(store_id, var_id)
        rows = np.asarray(indices, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= entry.value.shape[0]):
            raise IndexError(f"rows {rows.min()}..{rows.max()} of variable '{entry.spec.name}' with "
                             f"{entry.value.shape[0]} rows")
        found = entry.value[rows]
        self._count(store_id, found.nbytes)
        return entry.version, found

    def _count(self, store_id: str, nbytes: int) -> None:
        self._served[store_id] = self._served.get(store_id, 0) + int(nbytes)

    def _op_requests(self, store_id: str) -> int:
        """How many reads, gathers, updates and exchanges were served for ``store_id`` (round trips to this ps)."""
        return self._requests.get(store_id, 0)

    def _op_bytes_served(self, store_id: str) -> int:
        """Bytes of values sent for ``store_id`` (reads and row gathers; not round results)."""
        return self._served.get(store_id, 0)

    def _op_update(self, store_id: str, var_id: str, method: str, value: Any,
                   dedupe: tuple[str, int] | None = None, read_version: int | None = None) -> tuple[int, Any]:
        """``assign``/``assign_add``/``assign_sub`` applied once; ``(version, the new value, read-only)``.

        ``dedupe``: the update's key (closure id, n); an update whose key was
        already applied to this variable is not applied again.
        ``read_version``: the version the updater computed from; the
        difference to the version it is applied to (its staleness) is
        recorded (``staleness`` operation).
        """
        version = self._update(store_id, var_id, method, value, dedupe, read_version)
        return version, hand_out(self._entry(store_id, var_id))

    def _update(self, store_id: str, var_id: str, method: str, value: Any,
                dedupe: tuple[str, int] | None, read_version: int | None) -> int:
        entry = self._entry(store_id, var_id)
        if dedupe is not None and self._seen_before(store_id, var_id, dedupe):
            return entry.version
        self._record_staleness(store_id, entry, read_version)
        apply_method(entry, method, value)
        return entry.version

    def _record_staleness(self, store_id: str, entry: Entry, read_version: int | None) -> None:
        if read_version is not None and read_version >= 0:
            self._staleness.setdefault(store_id, collections.deque(maxlen=_STALENESS_HISTORY)).append(
                entry.version - int(read_version))

    def _op_exchange(self, store_id: str, updates: list[tuple[Any, ...]] = (),  # type: ignore[assignment]
                     reads: dict[str, int] | None = None,
                     gathers: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """A worker's batch for this store: apply ``updates`` in order, then serve ``reads`` and ``gathers``.

        ``updates``: ``("update", var_id, method, value, dedupe, read_version)``
        or ``("scatter", var_id, method, indices, values, dedupe,
        read_version)``, each applied once per dedupe key, as the single
        operations do. ``reads``: ``{var_id: version the worker holds}``;
        only the variables changed since are sent (``None`` for the others).
        ``gathers``: ``{var_id: rows}``. Returns ``{"versions": {var_id:
        version after the updates}, "values": {var_id: (version, value or
        None)}, "rows": {var_id: (version, rows)}}``. The batch is applied
        in one go on the event loop: no other request sees half of it.
        """
        versions: dict[str, int] = {}
        for update in updates:
            kind, var_id, *rest = update
            if kind == "update":
                versions[var_id] = self._update(store_id, var_id, *rest)
            elif kind == "scatter":
                versions[var_id] = self._op_scatter(store_id, var_id, *rest)
            else:
                raise ValueError(f"unknown update kind {kind!r}")
        values = {var_id: self._op_read(store_id, var_id, newer_than) for var_id, newer_than in (reads or {}).items()}
        rows = {var_id: self._op_gather(store_id, var_id, indices) for var_id, indices in (gathers or {}).items()}
        return {"versions": versions, "values": values, "rows": rows}

    def _op_scatter(self, store_id: str, var_id: str, method: str, indices: Any, values: Any,
                    dedupe: tuple[str, int] | None = None, read_version: int | None = None) -> int:
        """Rows ``indices`` updated with ``values`` (``add``, ``sub`` or ``update``), once; the new version.

        Repeated indices add up (``add``/``sub``), as TF's ``scatter_add``.
        ``dedupe`` and ``read_version`` as for ``update``.
        """
        entry = self._entry(store_id, var_id)
        if dedupe is not None and self._seen_before(store_id, var_id, dedupe):
            return entry.version
        self._record_staleness(store_id, entry, read_version)
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        delta = np.asarray(as_array(values)[0], dtype=entry.value.dtype)
        if delta.shape != (len(rows), *entry.value.shape[1:]):
            raise ValueError(f"scatter_{method} of variable '{entry.spec.name}': values of shape {delta.shape} "
                             f"for {len(rows)} rows of shape {tuple(entry.value.shape[1:])}")
        if rows.size and (rows.min() < 0 or rows.max() >= entry.value.shape[0]):
            raise IndexError(f"scatter_{method}: rows {rows.min()}..{rows.max()} of variable "
                             f"'{entry.spec.name}' with {entry.value.shape[0]} rows")
        if method not in ("add", "sub", "update"):
            raise ValueError(f"unknown scatter method {method!r}")
        table = writable(entry)
        if method == "add":
            np.add.at(table, rows, delta)
        elif method == "sub":
            np.subtract.at(table, rows, delta)
        else:
            table[rows] = delta
        entry.version += 1
        return entry.version

    def _seen_before(self, store_id: str, var_id: str, dedupe: tuple[str, int]) -> bool:
        """Whether the update keyed ``dedupe`` was applied to this variable already (then it is counted)."""
        applied = self._applied.setdefault((store_id, var_id), OrderedDict())
        key = tuple(dedupe)
        if key in applied:
            self._duplicates[store_id] = self._duplicates.get(store_id, 0) + 1
            return True
        applied[key] = None
        if len(applied) > _DEDUPE_WINDOW:
            applied.popitem(last=False)
        return False

    def _op_staleness(self, store_id: str) -> list[int]:
        """The staleness of the recent asynchronous updates (versions applied in between), oldest first."""
        return list(self._staleness.get(store_id, ()))

    def _op_duplicates(self, store_id: str) -> int:
        """How many deduplicated updates were skipped (a closure run again after a failure)."""
        return self._duplicates.get(store_id, 0)

    def _op_apply_fn(self, store_id: str, var_id: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(variable, *args, **kwargs)`` on the stored variable, once (TF's ``extended.update``)."""
        from daskdist.variables.distributed import Variable

        entry = self._entry(store_id, var_id)
        writable(entry)
        variable = StoredVariable.wrap(entry)
        try:
            result = fn(variable, *args, **kwargs)
        finally:
            entry.version += 1
        if result is variable:
            return copy_to_host(entry.value)
        if isinstance(result, Variable):
            return result.read_value()
        return result

    def _op_drop(self, store_id: str) -> int:
        """Forget everything held for ``store_id`` (its strategy closed); how many variables went."""
        dropped = [k for k in self._entries if k[0] == store_id]
        for key in dropped:
            del self._entries[key]
        for key in [k for k in self._params if k[0] == store_id]:
            del self._params[key]
        self._served.pop(store_id, None)
        self._requests.pop(store_id, None)
        self._duplicates.pop(store_id, None)
        self._staleness.pop(store_id, None)
        for applied_key in [k for k in self._applied if k[0] == store_id]:
            del self._applied[applied_key]
        self._rounds.drop_store(store_id, f"the parameters of {store_id} were dropped (the strategy closed)")
        return len(dropped)

    def _op_versions(self, store_id: str) -> dict[str, int]:
        """Every variable of ``store_id`` with its version (for tests and staleness figures)."""
        return {k[1]: e.version for k, e in self._entries.items() if k[0] == store_id}

    # -- synchronous rounds ---------------------------------------------------------------

    async def _op_contribute(self, store_id: str, key: str, round_id: int, rank: int, size: int, kind: str,
                             has_payload: bool, payload: Any, wait: float) -> dict[str, Any]:
        """Add ``rank``'s contribution to round ``round_id`` of ``key``; wait up to ``wait`` s for the result.

        Returns ``{"status": "OK", "result": ...}`` once every one of ``size``
        ranks contributed and the round was finished (``kind``:
        ``"variable"`` or ``"gradients"``), else ``{"status": "waiting"}``
        (the caller asks again without its payload). A finished round is
        forgotten once every rank has fetched its result. On the event loop;
        ``run_sync`` (a replica of this process, the direct channel) waits
        in its own thread instead (``_contribute_blocking``).
        """
        round_key = (store_id, key, int(round_id))
        with self._lock:
            round_ = self._rounds.contribute(round_key, int(rank), int(size), has_payload, payload,
                                             functools.partial(self._finish, store_id, key, kind))
        if not await round_.wait_async(wait):
            return {"status": "waiting"}
        with self._lock:
            return self._rounds.collect(round_key, round_, int(rank))

    def _contribute_blocking(self, store_id: str, key: str, round_id: int, rank: int, size: int, kind: str,
                             has_payload: bool, payload: Any, wait: float) -> dict[str, Any]:
        """``contribute`` from a thread: the wait blocks that thread, never holding the store's lock."""
        round_key = (store_id, key, int(round_id))
        with self._lock:
            round_ = self._rounds.contribute(round_key, int(rank), int(size), has_payload, payload,
                                             functools.partial(self._finish, store_id, key, kind))
        if not round_.wait(wait):
            return {"status": "waiting"}
        with self._lock:
            return self._rounds.collect(round_key, round_, int(rank))

    def _finish(self, store_id: str, key: str, kind: str, contributions: dict[int, Any]) -> Any:
        ordered = [contributions[r] for r in sorted(contributions)]
        if kind == "variable":
            return self._finish_variable_update(store_id, key.partition(":")[2], ordered)
        if kind == "gradients":
            return self._finish_gradients(store_id, key.partition(":")[2], ordered)
        raise ValueError(f"unknown round kind {kind!r}")

    def _finish_variable_update(self, store_id: str, var_id: str, ordered: list[dict[str, Any]]) -> tuple[int, Any]:
        """An assign made in replica context by every replica, aggregated and applied once (TF's merge_call)."""
        first = ordered[0]
        method, aggregation = first["method"], first["aggregation"]
        if any(c["method"] != method for c in ordered):
            raise ValueError(f"replicas updated variable {var_id!r} with different methods: "
                             f"{[c['method'] for c in ordered]}")
        if aggregation == "ONLY_FIRST_REPLICA":
            value = first["value"]
        else:
            value = functools.reduce(np.add, [np.asarray(to_numpy(as_array(c["value"])[0])) for c in ordered])
            if aggregation == "MEAN":
                value = value / len(ordered)
        entry = self._entry(store_id, var_id)
        apply_method(entry, method, value)
        return entry.version, copy_to_host(entry.value)

    # -- a trainable's parameters with their update rule ------------------------------------------

    def _finish_gradients(self, store_id: str, key: str, ordered: list[dict[str, Any]]) -> dict[str, Any]:
        """Sum the replicas' weighted gradients and step statistics, run the update rule once, return the new parameters.

        ``stats[0]`` is the step's rows: the gradients summed are divided by
        it (the global mean); the other statistics are only summed.
        """
        entry = self._params.get((store_id, key))
        if entry is None:
            init = next((c["init"] for c in ordered if c.get("init") is not None), None)
            if init is None:
                raise RuntimeError(f"the parameter store holds no parameters {key!r}")
            params, rule = init
            entry = self._params[(store_id, key)] = _ParameterSet([copy_to_host(p) for p in params], rule)
        grads = [functools.reduce(np.add, parts) for parts in zip(*(c["grads"] for c in ordered))]
        stats = functools.reduce(np.add, [np.asarray(c["stats"], np.float64) for c in ordered])
        count = float(stats[0])
        if count > 0:
            if ordered[0]["lr"] is not None:  # None: the rule's own (a schedule of its step count)
                entry.rule.learning_rate = ordered[0]["lr"]
            scale = 1.0 / count
            entry.rule.apply(entry.params, [g * g.dtype.type(scale) for g in grads])
            entry.version += 1
        return {"params": [copy_to_host(p) for p in entry.params], "stats": stats, "version": entry.version}

    def _op_params_state(self, store_id: str, key: str) -> dict[str, Any] | None:
        """``{"params", "rule_state"}`` of the parameters held as ``key``, or ``None`` if none are."""
        entry = self._params.get((store_id, key))
        if entry is None:
            return None
        state = {k: copy_to_host(v) for k, v in entry.rule.get_state().items()}
        return {"params": [copy_to_host(p) for p in entry.params], "rule_state": state}

    def _op_params_set(self, store_id: str, key: str, params: list[Any] | None = None,
                       rule_state: dict[str, Any] | None = None) -> bool:
        """Overwrite the parameters held as ``key`` and/or their update-rule state; ``False`` if none are held."""
        entry = self._params.get((store_id, key))
        if entry is None:
            return False
        if params is not None:
            if len(params) != len(entry.params):
                raise ValueError(f"parameters {key!r}: {len(entry.params)} held, {len(params)} given")
            for target, value in zip(entry.params, params):
                namespace(target).copyto(target, as_array(value)[0], casting="unsafe")
        if rule_state is not None:
            entry.rule.set_state(rule_state)
        entry.version += 1
        return True

    def _op_params_drop(self, store_id: str, key: str) -> bool:
        """Forget the parameters held as ``key`` and their update rule; whether any were held."""
        return self._params.pop((store_id, key), None) is not None

    def _op_params_keys(self, store_id: str) -> list[str]:
        """The keys of the parameter sets held for ``store_id`` (one per trainable held here)."""
        return sorted(k[1] for k in self._params if k[0] == store_id)

    # -- parameters pushed asynchronously (the parameter-server step driver) ---------------------

    def _op_params_init(self, store_id: str, key: str, params: list[Any], rule: Any) -> int:
        """Hold ``params`` (this store's part of a trainable's) and their update rule, unless held already.

        Returns the version. The first caller wins: every worker offers its
        freshly built copy, all then pull the one kept.
        """
        held = (store_id, key)
        if held not in self._params:
            self._params[held] = _ParameterSet([copy_to_host(p) for p in params], rule)
        return self._params[held].version

    def _parameter_set(self, store_id: str, key: str) -> _ParameterSet:
        try:
            return self._params[(store_id, key)]
        except KeyError:
            raise KeyError(f"the parameter store holds no parameters {key!r}") from None

    def _op_params_pull(self, store_id: str, key: str, newer_than: int = -1) -> tuple[int, Any]:
        """``(version, copies of the parameters)``, or ``(version, None)`` if not newer than ``newer_than``."""
        entry = self._parameter_set(store_id, key)
        if entry.version <= newer_than:
            return entry.version, None
        params = [copy_to_host(p) for p in entry.params]
        self._count(store_id, sum(p.nbytes for p in params))
        return entry.version, params

    def _op_params_push(self, store_id: str, key: str, grads: list[Any], lr: float | None,
                        dedupe: tuple[str, int] | None = None, read_version: int | None = None) -> tuple[int, Any]:
        """One worker's mean gradients, the update rule run here once; ``(version, new parameters)``.

        ``dedupe`` (closure id, n): a push already applied is not applied again
        (a closure run again after its worker was lost). ``read_version``: the
        version the gradients were computed from (recorded as staleness).
        """
        entry = self._parameter_set(store_id, key)
        if read_version is not None and read_version >= 0:
            self._staleness.setdefault(store_id, collections.deque(maxlen=_STALENESS_HISTORY)).append(
                entry.version - int(read_version))
        if dedupe is None or not self._seen_before(store_id, f"params:{key}", dedupe):
            if lr is not None:  # None: the rule's own (a schedule of its step count)
                entry.rule.learning_rate = lr
            entry.rule.apply(entry.params, [np.asarray(to_numpy(g)) for g in grads])
            entry.version += 1
        params = [copy_to_host(p) for p in entry.params]
        self._count(store_id, sum(p.nbytes for p in params))
        return entry.version, params

