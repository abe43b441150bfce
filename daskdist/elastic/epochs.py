"""The input of an elastic ``fit``, epoch by epoch: which rows, in which order, in global batches of which size.

Client side. An elastic epoch must be re-plannable from any committed step
over whatever replicas are left, with every row of the epoch in exactly one
committed update. So the order of an epoch's rows is decided here, on the
client, before the epoch starts:

* Without a ``shuffle`` before the batch, the epoch reads its rows in source
  order (as without elasticity).
* A ``shuffle(buffer_size, seed, reshuffle_each_iteration)`` before the batch
  becomes a *full, seeded permutation* of the epoch's rows,
  ``numpy.random.default_rng([seed, epoch]).permutation(rows)`` (epoch ``0``
  for every epoch when ``reshuffle_each_iteration=False`` or a ``cache()``
  follows the shuffle, which in TF freezes the first epoch's order). This is
  not TF's windowed buffer (whose order depends on ``buffer_size``): every
  row may land anywhere in the epoch, as with a buffer at least as large as
  the data. ``seed=None`` draws a seed once per ``fit`` on the client.
  The permutation is applied as an ``ops.Gather`` (``data/planner.py`` splits
  it by global batch, reading each row where it lives).

Global batches are the dataset's ``batch(B)`` (``keep="global_batch"``) or
``B / n0`` rows per replica times the current replica count
(``keep="per_replica"``, ``n0`` the replica count at the start of ``fit``).
Other ops that change which rows an epoch holds (``filter``, ``repeat``,
``shard``, ``unbatch``, a ``take``/``skip`` after the shuffle, ops after the
batch other than ``map``/``cache``/``prefetch``) are refused with a clear
error at the start of ``fit``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from daskdist.data import ops
from daskdist.data.dataset import Dataset
from daskdist.data.distributed import DistributedDataset
from daskdist.data.options import InputOptions
from daskdist.data.planner import Planned, cut_pipeline, plan_dataset
from daskdist.data.sources import DaskSource
from daskdist.data.split import global_batch_sizes
from daskdist.elastic.ledger import EpochSchedule, RowMap
from daskdist.elastic.options import ElasticOptions

__all__ = ["EpochInput", "EpochPlans", "check_elastic_pipeline", "release"]

logger = logging.getLogger(__name__)

_ROW_OPS = (ops.Map, ops.Cache, ops.Prefetch, ops.Shuffle)
_AFTER_OPS = (ops.Map, ops.Cache, ops.Prefetch)
_WHY = {
    ops.Filter: "filter() before the batch: which rows a step holds would only be known by reading them; filter "
                "the data before building the dataset (on the Dask collection or array)",
    ops.Repeat: "repeat(): fit's epochs already repeat the data; drop repeat() and pass epochs=",
    ops.Shard: "shard(): the strategy splits the data over the replicas itself",
    ops.Unbatch: "unbatch() before the last batch",
    ops.Take: "take() after a shuffle (take before the shuffle, or on the source)",
    ops.Skip: "skip() after a shuffle (skip before the shuffle, or on the source)",
}


def check_elastic_pipeline(dataset: Any) -> ops.Shuffle | None:
    """Refuse what an elastic epoch cannot re-plan; returns the pipeline's ``shuffle`` before the batch, if any.

    Raises
    ------
    ValueError
        Naming the op that is not supported and what to do instead.
    """
    if not isinstance(dataset, Dataset):
        raise ValueError("elastic fit needs a dd.data.Dataset (from_dask, from_tensor_slices, range, or arrays "
                         "with batch_size); datasets from distribute_datasets_from_function cannot be re-planned")
    parts = cut_pipeline(dataset)
    shuffles = [op for op in parts.row_ops if isinstance(op, ops.Shuffle)]
    for op in parts.row_ops:
        if not isinstance(op, _ROW_OPS):
            why = _WHY.get(type(op), f"{op.describe()} before the batch")
            raise ValueError(f"elastic fit cannot re-plan this dataset after a loss: {why}")
    if len(shuffles) > 1:
        raise ValueError("elastic fit supports one shuffle() before the batch, this dataset has "
                         f"{len(shuffles)}")
    for op in parts.after_ops:
        if not isinstance(op, _AFTER_OPS):
            raise ValueError(f"elastic fit cannot re-plan this dataset after a loss: {op.describe()} after the "
                             "batch changes which batches an epoch has (only map, cache and prefetch may follow "
                             "the batch; shuffle rows before the batch)")
    return shuffles[0] if shuffles else None


class EpochInput:
    """An elastic ``fit``'s training data: each epoch's row order and the datasets planning its rest.

    Parameters
    ----------
    strategy
        The elastic strategy.
    dataset
        The training dataset as the user wrote it (batched with the global batch).
    options
        The strategy's ``ElasticOptions`` (``keep``).
    """

    def __init__(self, strategy: Any, dataset: Dataset, options: ElasticOptions):
        self.strategy = strategy
        self.dataset = dataset
        self.options = options
        self.shuffle = check_elastic_pipeline(dataset)
        transformations = dataset.transformations
        self._batch_index = max(i for i, op in enumerate(transformations) if isinstance(op, ops.Batch))
        batch = transformations[self._batch_index]
        assert isinstance(batch, ops.Batch)
        self.batch_size = batch.batch_size
        self.drop_remainder = batch.drop_remainder
        self._shuffle_index = None if self.shuffle is None else transformations.index(self.shuffle)
        self.seed: int | None = None
        self.frozen_order = False
        if self.shuffle is not None:
            self.seed = self.shuffle.seed if self.shuffle.seed is not None else _fresh_seed()
            cache_after = any(isinstance(op, ops.Cache) for op in transformations[self._shuffle_index:self._batch_index])
            self.frozen_order = (not self.shuffle.reshuffle_each_iteration) or cache_after
        # a Dask source stays in the cluster for the whole fit: each epoch's plan reads it without computing
        # it again (a partition lost with a worker is computed again from its graph)
        self._held = ([strategy.extended.client.persist(c) for c in dataset.source.collections]
                      if isinstance(dataset.source, DaskSource) else [])
        # the rows of an epoch, in source order: the pipeline without its shuffle, planned once
        self.source_order = Dataset(dataset.source, tuple(op for op in transformations if op is not self.shuffle))
        workers = tuple(strategy.extended.worker_addresses)
        planned = plan_dataset(strategy.extended.client, list(workers), self.source_order, GLOBAL_SPLIT)
        self.rows = RowMap.from_plan(planned.plan, self.batch_size)
        # without a shuffle this is also the plan of the first epoch from its first step (``EpochPlans.rest``
        # registers it instead of planning again); nothing is registered here
        self._source_plan: tuple[tuple[str, ...], Planned] | None = (
            (workers, planned) if self.shuffle is None else None)
        self.first_replicas = strategy.num_replicas_in_sync
        self.per_replica_batch: int | None = None
        if options.keep == "per_replica":
            if self.batch_size % self.first_replicas:
                raise ValueError(f"keep='per_replica' needs a global batch divisible by the replica count: "
                                 f"batch({self.batch_size}) over {self.first_replicas} replicas")
            self.per_replica_batch = self.batch_size // self.first_replicas
        self._orders: dict[int, np.ndarray] = {}

    @property
    def total_rows(self) -> int:
        return self.rows.total_rows

    def global_batch(self, num_replicas: int) -> int:
        """The global batch over ``num_replicas`` replicas (constant unless ``keep="per_replica"``)."""
        if self.per_replica_batch is None:
            return self.batch_size
        return self.per_replica_batch * num_replicas

    def order(self, epoch: int) -> np.ndarray | None:
        """Epoch ``epoch``'s row order (epoch positions), or ``None`` for source order."""
        if self.shuffle is None:
            return None
        key = 0 if self.frozen_order else int(epoch)
        if key not in self._orders:
            self._orders = {key: np.random.default_rng([int(self.seed or 0), key]).permutation(self.total_rows)}
        return self._orders[key]

    def schedule(self, epoch: int) -> EpochSchedule:
        """A fresh step -> rows schedule of ``epoch`` (segments are added as its rest is planned)."""
        return EpochSchedule(self.total_rows, self.order(epoch))

    def steps_from(self, first_row: int, num_replicas: int) -> int:
        """Global batches in the rows from ``first_row`` on, over ``num_replicas`` replicas."""
        rest = max(self.total_rows - first_row, 0)
        return len(global_batch_sizes(rest, self.global_batch(num_replicas), self.drop_remainder))

    def source_plan(self, first_row: int, workers: tuple[str, ...]) -> Planned | None:
        """The plan of the rows from ``first_row`` over ``workers`` made to count the rows, when it is that
        (no shuffle, from the first row, the same members and global batch), once; else ``None``."""
        kept, self._source_plan = self._source_plan, None
        if kept is None or first_row or kept[0] != workers or self.global_batch(len(workers)) != self.batch_size:
            return None
        return kept[1]

    def dataset_from(self, epoch: int, first_row: int, num_replicas: int) -> Dataset:
        """The rows of ``epoch`` from row ``first_row`` of its order on, in global batches for ``num_replicas``."""
        transformations = list(self.dataset.transformations)
        transformations[self._batch_index] = ops.Batch(self.global_batch(num_replicas), self.drop_remainder)
        order = self.order(epoch)
        if order is not None:
            assert self._shuffle_index is not None
            transformations[self._shuffle_index] = ops.Gather(order[first_row:])
        elif first_row:
            transformations.insert(self._batch_index, ops.Skip(first_row))  # folded into the plan's row range
        return Dataset(self.dataset.source, tuple(transformations))

    def describe_order(self) -> str:
        if self.shuffle is None:
            return "source order"
        how = "the same every epoch" if self.frozen_order else "a new one each epoch"
        return f"a seeded permutation of all {self.total_rows} rows (seed {self.seed}, {how})"


#: Elastic epochs are planned with TF's exact split: the ledger counts global batch ``k`` as epoch positions
#: ``[k * B, (k + 1) * B)`` of the epoch order, whatever the source (the default for Dask data is ``"balanced"``)
GLOBAL_SPLIT = InputOptions(experimental_split="global")


def _fresh_seed() -> int:
    """A seed for a ``shuffle(seed=None)``: drawn once per ``fit`` on the client, so every re-plan agrees."""
    return int(np.random.SeedSequence().entropy % (2**63))  # type: ignore[operator]


def release(strategy: Any, distributed: Any) -> None:
    """Drop a distributed dataset's shards on the replicas: the plan of an epoch (or its rest) that is over.

    Each shuffled epoch, and each rest of an epoch after a membership change, is a new distributed dataset;
    without this the replicas would keep every one's rows (a local source's rows are copied into them).
    """
    from daskdist.data.replica import forget_dataset

    strategy.extended.run_on_replicas(forget_dataset, (distributed.dataset_id,))


class EpochPlans:
    """The distributed dataset of the rest of an epoch, planned again when its start or the members change.

    One per elastic fit (the built-in layers' and the Keras 3 adapter's). A
    plan that is over (a new row to start from, new members) is released on
    the replicas at the next ``rest``: its shards leave their memory.

    Parameters
    ----------
    strategy
        The elastic strategy.
    epoch_input
        The fit's ``EpochInput``.
    """

    def __init__(self, strategy: Any, epoch_input: EpochInput):
        self.strategy = strategy
        self.input = epoch_input
        self._planned: tuple[tuple[Any, ...], Any] | None = None  # (what it was planned for, distributed dataset)
        self._stale: list[Any] = []  # distributed datasets whose shards the replicas may drop

    def rest(self, epoch: int, schedule: Any, first: int, limit: int | None, size: int) -> tuple[Any, int]:
        """The epoch's global batches from step ``first`` on over ``size`` members, and the epoch's steps.

        A loss while the old plans are released raises here (the caller recovers and asks again).
        """
        row = schedule.row_of_step(first) if first else 0
        schedule.start(first, row, self.input.global_batch(size))
        total = first + self.input.steps_from(row, size)
        if limit is not None:
            total = min(total, int(limit))
        order_key = None if self.input.shuffle is None else (0 if self.input.frozen_order else epoch)
        wanted = (order_key, row, tuple(self.strategy.extended.worker_addresses))
        if self._planned is None or self._planned[0] != wanted:
            self.forget()
            dataset = self.input.dataset_from(epoch, row, size)
            planned = self.input.source_plan(row, wanted[2])
            if planned is None:
                distributed = self.strategy.experimental_distribute_dataset(dataset, GLOBAL_SPLIT)
            else:  # the plan the rows were counted with is this one: registered, not made again
                self.strategy.extended.check_open()
                distributed = DistributedDataset.from_dataset(self.strategy.extended, dataset, GLOBAL_SPLIT, planned)
            self._planned = (wanted, distributed)
        while self._stale:
            release(self.strategy, self._stale[-1])
            self._stale.pop()
        return self._planned[1], total

    def forget(self) -> None:
        """Plan again at the next ``rest`` (the members changed); the current plan is released then."""
        if self._planned is not None:
            self._stale.append(self._planned[1])
        self._planned = None
