"""``ParameterServerV1Extended``: TF1's between-graph parameter-server semantics over the v2 machinery."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from daskdist.ps.client import (
    PerWorkerIterator,
    PerWorkerValues,
    WorkerResource,
    make_dataset,
    make_iterator,
    run_closure,
)
from daskdist.strategy.extended.contract import Args, Kwargs
from daskdist.strategy.extended.parameter_server import ParameterServerExtended

__all__ = ["ParameterServerV1Extended"]


class ParameterServerV1Extended(ParameterServerExtended):
    """``call_for_each_replica`` on every worker, each on its own (TF1's between-graph workers)."""

    _call_ids = 0

    def _call_for_each_replica(self, fn: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        groups = list(self.worker_groups.values())
        type(self)._call_ids += 1
        call_id = f"v1-{self.token}-{type(self)._call_ids}"

        def on_worker(index: int) -> Any:
            worker_args = _select(args, index)
            worker_kwargs = _select(kwargs, index)
            return groups[index].call(run_closure, (f"{call_id}-{index}", fn, worker_args, worker_kwargs))[0]

        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            results = list(pool.map(on_worker, range(len(groups))))
        return PerWorkerValues(tuple(results))

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any:
        return _PerWorkerInput(self, dataset_fn)

    def distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return _PerWorkerInput(self, lambda ctx: dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id))


def _select(structure: Any, index: int) -> Any:
    import optree

    return optree.tree_map(lambda x: x.values[0] if isinstance(x, PerWorkerIterator)
                           else (x.values[index] if isinstance(x, PerWorkerValues) else x),
                           structure, is_leaf=lambda x: isinstance(x, PerWorkerValues), none_is_leaf=True)


class _PerWorkerInput:
    """A dataset built on every worker; ``iter()`` gives per-worker iterators for ``run``."""

    def __init__(self, extended: ParameterServerV1Extended, dataset_fn: Callable[[Any], Any]):
        import uuid

        self._extended = extended
        self._key = f"ps-dataset:{uuid.uuid4().hex[:12]}"
        groups = list(extended.worker_groups.values())
        for index, group in enumerate(groups):
            group.call(make_dataset, (self._key, dataset_fn, index, len(groups)))

    def __iter__(self) -> PerWorkerValues:
        import uuid

        key = f"ps-iterator:{uuid.uuid4().hex[:12]}"
        groups = list(self._extended.worker_groups.values())
        for group in groups:
            group.call(make_iterator, (self._key, key))
        return PerWorkerIterator(tuple(WorkerResource(key) for _ in groups))


