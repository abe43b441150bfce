"""``ParameterServerStrategy``: variables on ps members, asynchronous workers driven by a ``ClusterCoordinator``.

TensorFlow's ``tf.distribute.ParameterServerStrategy`` (``parameter_server_strategy_v2.py``) on Dask:

* the client is TF's ``chief`` (the coordinator);
* each ``ps`` member is a Dask worker holding a parameter store
  (``daskdist.ps.store``); variables created in ``scope()`` go to the stores
  round-robin, or are split by ``variable_partitioner`` into a
  ``ShardedVariable`` whose shards go round-robin;
* each ``worker`` member is a Dask worker running a one-replica group of its
  own (``num_replicas_in_sync == 1``): a worker that dies takes only its own
  closure with it. Workers read parameters from the stores and push their
  updates to them directly (Dask comms, worker to worker, never through the
  scheduler); the updates are applied on the ps, each closure's updates at
  most once (keyed by closure id);
* functions run on workers through ``ClusterCoordinator.schedule``.

The cluster comes from a resolver whose ``cluster_spec()`` lists Dask worker
addresses under ``ps`` and ``worker`` (and optionally one ``chief``, the
client); any object with ``cluster_spec()`` returning a ``ClusterSpec`` or a
dict works.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from distributed import Client

from daskdist import context, registry
from daskdist.exceptions import StrategyClosedError
from daskdist.strategy.base import Strategy
from daskdist.strategy.extended.parameter_server import (
    PS_STRATEGY_KEY,
    RUN_WITHOUT_SCHEDULE,
    ParameterServerExtended,
)

__all__ = ["ParameterServerStrategy"]

logger = logging.getLogger(__name__)

class ParameterServerStrategy(Strategy):
    """Asynchronous training with parameter servers (TF's ``tf.distribute.ParameterServerStrategy``).

    Parameters
    ----------
    cluster_resolver
        A resolver whose ``cluster_spec()`` lists Dask worker addresses under
        ``"ps"`` and ``"worker"`` (at least one of each; task types chief, ps
        and worker only).
    variable_partitioner
        ``None`` (each variable whole, stores round-robin) or a partitioner
        from ``dd.experimental.partitioners``.
    client
        The ``distributed.Client``; ``None``: the resolver's, else the
        default client.

    Notes
    -----
    Use it with ``dd.experimental.coordinator.ClusterCoordinator(strategy)``:
    ``schedule`` runs functions on whichever worker is free. Each worker has
    one replica (``num_replicas_in_sync == 1``); workers are asynchronous.
    """

    def __init__(self, cluster_resolver: Any, variable_partitioner: Any = None, *, client: Client | None = None):
        self._coordinator: Any = None
        super().__init__(ParameterServerExtended(self, cluster_resolver, variable_partitioner, client))

    @property
    def cluster_resolver(self) -> Any:
        """The resolver the strategy was made with (TF's ``cluster_resolver``)."""
        return self._ps_extended.cluster_resolver

    @property
    def _ps_extended(self) -> ParameterServerExtended:
        extended = self._extended
        assert isinstance(extended, ParameterServerExtended)
        return extended

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """``Strategy.reduce`` on the coordinator, with TF's warning (inside scheduled functions it is the worker's)."""
        logger.warning(RUN_WITHOUT_SCHEDULE)
        return super().reduce(reduce_op, value, axis)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (_resolve_ps_strategy, (self._extended.token,))


def _resolve_ps_strategy(token: str) -> Any:
    """Unpickle the strategy: on a worker running a closure, that worker's view; on the client, the strategy."""
    runtime = context.current_runtime()
    if runtime is not None:
        try:
            if runtime.objects.find(*PS_STRATEGY_KEY) == token:
                return runtime.strategy_view
        except AttributeError:
            pass
    owner = registry.lookup(token)
    if owner is None or owner.strategy is None:
        raise StrategyClosedError(f"strategy {token} is closed or lives in another process")
    return owner.strategy
