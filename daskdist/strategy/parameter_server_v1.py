"""TF1's ``tf.compat.v1.distribute.experimental.ParameterServerStrategy``, as a facade over the v2 machinery.

In TensorFlow 1 every worker runs the same program on its own (between-graph
replication): synchronous over its local devices, asynchronous between
workers, variables and their updates on the ps. daskdist has one client, so
the facade runs each call on every worker at once, each worker independently:

* ``run(fn, args)`` / ``extended.call_for_each_replica(fn, args)``: ``fn`` on
  every worker (concurrently; a worker does not wait for another), the
  results as ``PerWorkerValues`` in worker order;
* ``distribute_datasets_from_function(dataset_fn)``: ``dataset_fn(InputContext(
  num_input_pipelines=workers, input_pipeline_id=worker index))`` on every
  worker; ``experimental_distribute_dataset(dataset)``: each worker reads
  ``dataset.shard(workers, index)``. Iterating gives per-worker iterators to
  pass to ``run``, where ``next(it)`` reads that worker's input;
* variables created in ``scope()`` live on the ps (round-robin), and
  operations "that occur only on the first replica (such as incrementing the
  global step) will occur on the first replica of every worker": a global step
  counts worker-steps.
"""

from __future__ import annotations

from typing import Any

from distributed import Client

from daskdist.strategy.extended.parameter_server_v1 import ParameterServerV1Extended
from daskdist.strategy.parameter_server import ParameterServerStrategy

__all__ = ["ParameterServerStrategyV1"]


class ParameterServerStrategyV1(ParameterServerStrategy):
    """TF1's parameter-server strategy (``tf.compat.v1.distribute.experimental.ParameterServerStrategy``).

    Parameters
    ----------
    cluster_resolver
        A resolver whose ``cluster_spec()`` has ``ps`` and ``worker`` jobs (Dask
        worker addresses or ``host:port``). ``None``: ``TFConfigClusterResolver()``
        (TF's default: the ``TF_CONFIG`` environment variable).
    client
        The ``distributed.Client``; ``None``: the default client.
    """

    def __init__(self, cluster_resolver: Any = None, *, client: Client | None = None):
        if cluster_resolver is None:
            from daskdist.cluster_resolver import TFConfigClusterResolver

            cluster_resolver = TFConfigClusterResolver()
        self._coordinator = None
        from daskdist.strategy.base import Strategy

        Strategy.__init__(self, ParameterServerV1Extended(self, cluster_resolver, None, client))
