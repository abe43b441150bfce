"""What a parameter-server worker sends to the stores during one closure: one pull and one push per store.

A closure reads variables and updates them. Sent one by one, that is a round
trip to a ps per read and per update. ``ClosureSession`` (installed by the
coordinator's ``run_closure`` for the closure a worker runs) batches them:

* **Pull.** The first read of a variable whose copy is not fresh in this
  closure pulls, in one ``exchange`` per store and all stores at once, every
  variable this worker read whole in its previous closure or in this one
  (its *working set*), sending the version it holds: a store sends only the
  variables that changed since. The other reads of the closure find their
  value already there.
* **Push.** ``assign``/``assign_add``/``assign_sub`` and ``scatter_*`` are
  queued, each with its dedupe key ``(closure id, n)`` (the n-th update of
  the closure: a closure run again after a failure makes the same keys), and
  the version it was computed from (staleness). At the end of the closure
  (also when it raised), one ``exchange`` per store carries all of them and
  the store applies them in order, in one go.
* **Pull-ahead** (``daskdist.parameter-store.pull-ahead``, on by default).
  The push at the end of a closure also pulls the working set, in the same
  request: the worker's next closure finds its values there and sends
  nothing to the stores until its end, one round trip per closure instead
  of two. The values it computes from are then those of the end of its
  previous closure (the store's staleness figures count it). They are not
  used if the client wrote a variable since (the coordinator tells the
  worker how many writes the client made), nor by a closure that is not the
  worker's next one.
* **Reads after writes.** A read of a variable with a queued update, or a
  row gather of one, first sends the queued updates of its store with the
  read, so the closure sees the value the store has after its update (and
  after other workers' updates), as TensorFlow's ops on the ps give.

Outside a closure (``strategy.run`` of the v1 facade, CentralStorage with one
replica) there is no session and every read and update is its own request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from daskdist import config
from daskdist.group.service import STRATEGY, ReplicaService
from daskdist.ps.refs import exchange_from_replica

if TYPE_CHECKING:
    from daskdist.ps.refs import StoreRef

__all__ = ["CLOSURE_KEY", "ClosureSession", "StoredView", "WorkingSet", "begin_closure", "current_session", "end_closure"]

logger = logging.getLogger(__name__)

class StoredView(Protocol):
    """What a session needs of a worker's view of a stored variable (``daskdist.ps.values.AggregatingVariable``)."""

    cached_run: Any  # the run (closure) whose value the view holds, or None: stale
    cached_version: int  # the store's version of the value the view holds

    @property
    def var_id(self) -> str: ...

    @property
    def store(self) -> StoreRef: ...

    def receive(self, version: int, value: Any, run_id: Any) -> None: ...


#: The resident under which a parameter-server worker keeps the session of the closure it runs.
CLOSURE_KEY = (STRATEGY, "ps-closure")
#: The resident under which a parameter-server worker keeps the variables it read whole lately.
WORKING_SET_KEY = (STRATEGY, "ps-working-set")


class WorkingSet:
    """The stored variables a worker read whole in its recent closures (pulled together at the first read)."""

    def __init__(self) -> None:
        self.closures = 0  # closures begun on this worker
        self._last_read: dict[str, tuple[StoredView, int]] = {}
        self.ahead: list[StoredView] = []  # pulled at the end of closure ``ahead_of``
        self.ahead_of = -1
        self.ahead_client_writes = -1

    def begin(self, service: ReplicaService, client_writes: int) -> None:
        """A closure starts: the values pulled ahead by the previous one are fresh for it, if still valid."""
        self.closures += 1
        if self.ahead_of == self.closures - 1 and self.ahead_client_writes == client_writes:
            for view in self.ahead:
                view.cached_run = service.run_id
        self.ahead, self.ahead_of = [], -1

    def mark_read(self, view: StoredView) -> None:
        self._last_read[view.var_id] = (view, self.closures)

    def hot(self) -> list[StoredView]:
        """Variables read whole in this closure or the previous one (older ones drop out)."""
        for var_id in [k for k, (_, n) in self._last_read.items() if n < self.closures - 1]:
            del self._last_read[var_id]
        return [view for view, _ in self._last_read.values()]


class ClosureSession:
    """The reads and queued updates of the closure a worker runs (see the module's description)."""

    def __init__(self, service: ReplicaService, closure_id: str, working_set: WorkingSet, client_writes: int = 0):
        self.runtime = service
        self.closure_id = closure_id
        self.working_set = working_set
        self.client_writes = client_writes
        self._updates = 0
        self._pending: dict[StoreRef, list[tuple[Any, ...]]] = {}
        self._pending_views: dict[str, StoredView] = {}
        self.exchanges = 0  # requests sent to stores (for tests and figures)

    # -- updates ---------------------------------------------------------------------------

    def next_dedupe_key(self) -> tuple[str, int]:
        """``(closure id, n)`` for the closure's n-th update (the same on a re-run: the same order)."""
        self._updates += 1
        return (self.closure_id, self._updates)

    def queue(self, view: StoredView, update: tuple[Any, ...]) -> None:
        """Queue ``update`` (an ``exchange`` update tuple) of ``view`` for its store."""
        self._pending.setdefault(view.store, []).append(update)
        self._pending_views[view.var_id] = view

    def has_pending(self, view: StoredView) -> bool:
        return view.var_id in self._pending_views

    # -- exchanges ---------------------------------------------------------------------------

    def pull(self, view: StoredView) -> None:
        """Make ``view``'s copy fresh: pull it with the working set, pushing what is queued for their stores."""
        self.working_set.mark_read(view)
        run_id = self.runtime.run_id
        stale = [v for v in self.working_set.hot() if v.cached_run != run_id or self.has_pending(v)]
        self._exchange({v.store for v in stale}, read_views=stale)

    def gather(self, view: StoredView, rows: Any) -> Any:
        """Rows ``rows`` of ``view`` (its queued updates, and its store's, are sent first)."""
        return self.gather_many([(view, rows)])[0]

    def gather_many(self, requests: list[tuple[StoredView, Any]]) -> list[Any]:
        """Rows of several variables: one request per store, all stores at once."""
        gathers: dict[StoreRef, dict[str, Any]] = {}
        for view, rows in requests:
            gathers.setdefault(view.store, {})[view.var_id] = rows
        replies = self._exchange(set(gathers), gathers=gathers)
        return [replies[view.store]["rows"][view.var_id][1] for view, _ in requests]

    def flush(self, pull_ahead: bool = False) -> None:
        """Push every queued update (the closure ends): one request per store, all at once.

        ``pull_ahead``: the same requests pull the working set for the
        worker's next closure.
        """
        if not pull_ahead:
            if self._pending:
                self._exchange(set(self._pending))
            return
        hot = self.working_set.hot()
        stores = set(self._pending) | {v.store for v in hot}
        if stores:
            self._exchange(stores, read_views=hot)
            ws = self.working_set
            ws.ahead, ws.ahead_of, ws.ahead_client_writes = hot, ws.closures, self.client_writes

    def _exchange(self, stores: set[StoreRef], read_views: list[StoredView] = (),  # type: ignore[assignment]
                  gathers: dict[StoreRef, dict[str, Any]] | None = None) -> dict[StoreRef, Any]:
        """One ``exchange`` with each of ``stores``: their queued updates, then the reads and gathers asked for."""
        gathers = gathers or {}
        reads: dict[StoreRef, dict[str, int]] = {}
        readers: dict[tuple[StoreRef, str], StoredView] = {}
        for view in read_views:
            reads.setdefault(view.store, {})[view.var_id] = view.cached_version
            readers[(view.store, view.var_id)] = view
        requests = {}
        for store in stores:
            request: dict[str, Any] = {"updates": self._pending.pop(store, [])}
            if reads.get(store):
                request["reads"] = reads[store]
            if gathers.get(store):
                request["gathers"] = gathers[store]
            requests[store] = request
        for view in [v for v in self._pending_views.values() if v.store in stores]:
            del self._pending_views[view.var_id]
            view.cached_run = None  # the copy no longer is the store's value (unless read back below)
        self.exchanges += len(requests)
        replies = exchange_from_replica(self.runtime, requests)
        run_id = self.runtime.run_id
        for store, reply in replies.items():
            for var_id, (version, value) in reply["values"].items():
                readers[(store, var_id)].receive(version, value, run_id)
        return replies


def begin_closure(service: ReplicaService, closure_id: str, client_writes: int = 0) -> ClosureSession:
    """Install the session of closure ``closure_id`` on this worker (``run_closure`` calls it first).

    ``client_writes``: how many variable writes the client made so far (the
    values pulled ahead are used only if it made none since).
    """
    working_set = service.objects.find(*WORKING_SET_KEY)
    if working_set is None:
        working_set = WorkingSet()
        service.objects.install(*WORKING_SET_KEY, working_set)
    working_set.begin(service, client_writes)
    session = ClosureSession(service, closure_id, working_set, client_writes)
    service.objects.install(*CLOSURE_KEY, session)
    return session


def end_closure(service: ReplicaService, session: ClosureSession, failed: bool) -> None:
    """Push the closure's queued updates and remove its session.

    Updates made before a closure's own error are applied too (as each op
    TensorFlow ran before the error took effect). A push that fails raises,
    unless the closure already failed (then its error is the one reported
    and the push's is logged).
    """
    try:
        session.flush(pull_ahead=not failed and bool(config.get("parameter-store.pull-ahead", True)))
    except Exception as e:
        if not failed:
            raise
        logger.warning("Closure %s failed, and pushing its updates failed too: %s", session.closure_id, e)
    finally:
        service.objects.discard(*CLOSURE_KEY)


def current_session(service: ReplicaService) -> ClosureSession | None:
    """The session of the closure this worker runs, or ``None`` outside closures."""
    session = service.objects.find(*CLOSURE_KEY)
    return session if isinstance(session, ClosureSession) else None
