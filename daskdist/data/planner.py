"""Planning a distributed dataset: the pipeline's parts, the rows of each replica, the plan.

The pipeline is cut at its last ``batch``: the ops before it work on rows,
those after it on global batches. Each replica runs the row ops on its own
rows, then a ``SplitBatch`` with its part of every global batch (TF's
split), then the ops after the batch.

Whether a step can hold exactly the undistributed batch depends on the row
ops: ``map``, ``cache`` and ``prefetch`` keep every row at its position, and
leading ``take``/``skip`` only choose a range of positions (they are folded
into the plan). A ``Gather`` (elastic training's seeded epoch order) picks
and orders rows the client knows: the ``"global"`` split still holds (each
step is the gathered batch, each replica takes TF's share of it), the
replica of each row of a batch chosen by where the row lives; each replica
reorders its own rows.
``shuffle`` keeps row counts but not positions: the split is
then ``"balanced"`` (each replica shuffles its own rows). ``filter``,
``shard``, ``repeat`` or ``unbatch`` before the batch change counts: replicas
batch their rows with their share of the batch size and stop together by the
partial-batch rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optree

from daskdist.data import ops
from daskdist.data.dataset import Dataset
from daskdist.data.options import AutoShardPolicy, InputOptions
from daskdist.data.placement import DaskRows, Read, select_rows
from daskdist.data.plan import Plan, PlannedRead
from daskdist.data.sources import DaskSource, LocalSource, Partition, Source
from daskdist.data.split import (
    GlobalBatchRows,
    SelectedRows,
    assign_by_locality,
    balanced_pieces,
    global_batch_sizes,
    homes,
    local_pieces,
    replica_split,
    replica_step_sizes,
)

__all__ = ["PipelineParts", "Planned", "ReplicaInput", "cut_pipeline", "plan_dataset"]

_POSITION_OPS = (ops.Map, ops.Cache, ops.Prefetch)
_COUNT_OPS = _POSITION_OPS + (ops.Shuffle,)
_AFTER_OPS = (ops.Map, ops.Cache, ops.Prefetch)


@dataclass
class PipelineParts:
    """A pipeline cut at its last ``batch``."""

    skip: int  # leading skip/take folded into a range of source positions
    take: int | None
    row_ops: tuple[ops.Op, ...]
    batch: ops.Batch
    after_ops: tuple[ops.Op, ...]
    kind: str  # "positions": rows keep positions; "gathered": one Gather orders them; "counts"; "unknown"

    @property
    def gather(self) -> ops.Gather | None:
        """The one ``Gather`` among the row ops of a ``"gathered"`` pipeline."""
        return next((op for op in self.row_ops if isinstance(op, ops.Gather)), None)


def cut_pipeline(dataset: Dataset) -> PipelineParts:
    transformations = dataset.transformations
    last = max((i for i, op in enumerate(transformations) if isinstance(op, ops.Batch)), default=None)
    if last is None or any(isinstance(op, ops.Unbatch) for op in transformations[last + 1 :]):
        raise ValueError("batch the dataset with the global batch size before distributing it: dataset.batch(B)")
    skip, take = 0, None
    leading = 0
    for op in transformations[:last]:
        if isinstance(op, ops.Skip):
            skip += max(op.count, 0)  # after a take too: ``take(10).skip(3)`` is rows 3..9
            take = None if take is None else max(0, take - max(op.count, 0))
        elif isinstance(op, ops.Take):
            if op.count >= 0:
                take = op.count if take is None else min(take, op.count)
        elif not isinstance(op, _POSITION_OPS):
            break
        leading += 1
    folded = [op for op in transformations[:leading] if not isinstance(op, (ops.Skip, ops.Take))]
    row_ops = tuple(folded) + tuple(transformations[leading:last])
    if all(isinstance(op, _POSITION_OPS) for op in row_ops):
        kind = "positions"
    elif (sum(isinstance(op, ops.Gather) for op in row_ops) == 1
          and all(isinstance(op, _POSITION_OPS + (ops.Gather,)) for op in row_ops)):
        kind = "gathered"
    elif all(isinstance(op, _COUNT_OPS) for op in row_ops):
        kind = "counts"
    else:
        kind = "unknown"
    batch = transformations[last]
    assert isinstance(batch, ops.Batch)
    return PipelineParts(skip, take, row_ops, batch, tuple(transformations[last + 1 :]), kind)


@dataclass
class ReplicaInput:
    """What one replica reads and runs."""

    source: Source
    partitions: list[Partition]
    dataset: Dataset


@dataclass
class Planned:
    plan: Plan
    inputs: list[ReplicaInput]
    futures: list[Any] = field(default_factory=list)
    steps: int | None = None
    pinned: list[tuple[str, Any]] = field(default_factory=list)  # (worker, future) holding each replica's rows


def plan_dataset(client: Any, workers: list[str], dataset: Dataset, options: InputOptions) -> Planned:
    """Decide each replica's rows and pipeline; place Dask rows on the replicas' workers."""
    n = len(workers)
    parts = cut_pipeline(dataset)
    batch_size, drop = parts.batch.batch_size, parts.batch.drop_remainder
    source = dataset.source
    policy = options.auto_shard_policy
    notes: list[str] = []
    if policy is AutoShardPolicy.FILE and len(source.partitions) < n:
        raise ValueError(
            f"FILE sharding needs at least as many partitions as replicas ({len(source.partitions)} < {n}); "
            "repartition the data or use AutoShardPolicy.AUTO (rows are then split, not partitions)"
        )
    dask_rows = DaskRows(client, source) if isinstance(source, DaskSource) else None
    rows = dask_rows.rows if dask_rows is not None else [p.rows for p in source.partitions]
    sizes = ([dask_rows.partition_bytes(i) for i in range(len(rows))] if dask_rows is not None
             else [p.nbytes for p in source.partitions])
    firsts = list(np.cumsum([0, *rows[:-1]])) if rows else []
    lo = min(parts.skip, sum(rows))
    hi = sum(rows) if parts.take is None else min(sum(rows), lo + parts.take)
    used = hi - lo
    gather = parts.gather if parts.kind == "gathered" else None
    if gather is not None:
        if len(gather.indices) and int(gather.indices.max()) >= used:
            raise ValueError(f"gather index {int(gather.indices.max())} out of range for the {used} rows before it")
        used = len(gather.indices)
    split = options.experimental_split
    if split is None:  # Dask data stays where it lives; rows in the client's memory follow TF's exact split
        split = "balanced" if dask_rows is not None and gather is None else "global"
    if policy is AutoShardPolicy.OFF:
        split = "everything"
    elif gather is not None and split != "global":
        raise ValueError(f"a gathered dataset (elastic training's epoch order) needs the 'global' split, not {split!r}")
    elif split == "global" and parts.kind != "positions" and gather is None:
        split = "balanced"
        notes.append("the ops before batch move rows (shuffle, filter ...): each replica runs them on a balanced "
                     "run of rows, so a step's rows are not the undistributed batch")
    local = dask_rows.local_bytes(workers) if dask_rows is not None else [{} for _ in rows]
    home = homes(local, sizes, n)
    if gather is not None and split == "global":
        reads, local_orders = _gathered_reads(rows, firsts, home, lo, hi, gather.indices, batch_size, drop, n)
    else:
        reads, local_orders = _reads(split, rows, firsts, home, lo, hi, batch_size, drop, n), None
    step_sizes = replica_step_sizes(used, batch_size, drop, n)
    exact_sizes = split in ("global", "balanced") and parts.kind != "unknown"
    each = replica_split(batch_size, n)
    inputs, futures, planned = [], [], []
    for rank in range(n):
        if dask_rows is not None:
            shard_partitions, kept, moved = dask_rows.place(reads[rank], workers[rank])
            futures.extend(kept)
            from daskdist.data.replica import KeyedSource

            keyed: Any = source  # a Dask source: its rows are keyed partitions

            shard_source: Source = KeyedSource(keyed.treedef, shard_partitions, keyed.assemble)
        else:
            shard_source = _local_rows(source, reads[rank])
            shard_partitions = list(shard_source.partitions)
            moved = [0] * len(reads[rank])
        batch = ops.SplitBatch(step_sizes[rank], drop) if exact_sizes else ops.Batch(max(each[rank], 1), drop)
        row_ops = parts.row_ops
        if local_orders is not None:  # the replica's own rows, in the gathered order
            row_ops = tuple(ops.Gather(local_orders[rank]) if isinstance(op, ops.Gather) else op for op in row_ops)
        ds = Dataset(shard_source, row_ops + (batch,) + parts.after_ops)
        inputs.append(ReplicaInput(shard_source, shard_partitions, ds))
        for read, m in zip(reads[rank], moved):
            taken = _taken(read)
            whole = rows[read.partition]
            nbytes = int(sizes[read.partition] * taken / whole) if whole else 0
            planned.append(PlannedRead(read.partition, rank, workers[rank], read.start, read.stop, taken, nbytes, m))
    steps, replica_steps = _steps(parts, exact_sizes, used, batch_size, drop, planned, each, n)
    plan = Plan(planned, list(workers), each, policy.name, split, steps, replica_steps, notes)
    return Planned(plan, inputs, futures, steps, getattr(dask_rows, "pinned", []))


def _reads(split: str, rows: list[int], firsts: list[int], home: list[int], lo: int, hi: int, batch_size: int,
           drop: bool, n: int) -> list[list[Read]]:
    """Per replica, the row ranges it reads (positions ``[lo, hi)`` of the source)."""
    clipped = [(i, max(0, lo - f), min(r, hi - f)) for i, (r, f) in enumerate(zip(rows, firsts))]
    clipped = [(i, a, b) for i, a, b in clipped if b > a]
    if split == "everything":
        return [[Read(i, a, b, firsts[i] - lo) for i, a, b in clipped] for _ in range(n)]
    if split == "global":
        out = []
        for rank in range(n):
            rule = GlobalBatchRows(hi - lo, batch_size, drop, n, rank)
            mine = [Read(i, a, b, firsts[i] - lo, rule) for i, a, b in clipped]
            out.append([r for r in mine if _taken(r) > 0])
        return out
    counts = [b - a for _, a, b in clipped]
    owners = [home[i] for i, _, _ in clipped]
    if split == "local":
        pieces = local_pieces(counts, owners, n)
    else:
        targets = [sum(s) for s in replica_step_sizes(hi - lo, batch_size, drop, n)]
        pieces = balanced_pieces(counts, owners, targets)
    starts = {k: a for k, (_, a, _) in enumerate(clipped)}
    return [[Read(clipped[p.partition][0], starts[p.partition] + p.start, starts[p.partition] + p.stop,
                  firsts[clipped[p.partition][0]] - lo) for p in share] for share in pieces]


def _gathered_reads(rows: list[int], firsts: list[int], home: list[int], lo: int, hi: int, indices: np.ndarray,
                    batch_size: int, drop: bool, n: int) -> tuple[list[list[Read]], list[np.ndarray]]:
    """``"global"`` split of a gathered pass: per replica its reads and the order of the rows they bring.

    Gathered row ``q`` (position ``indices[q]`` of ``[lo, hi)``) belongs to
    global batch ``q // batch_size``; each replica takes TF's share of every
    batch, chosen among the batch's rows its worker holds first
    (``assign_by_locality``), reads those rows where they are, in source
    order, and puts them back in gathered order with a local ``Gather``.
    """
    if len(np.unique(indices)) != len(indices):
        raise ValueError("a gathered dataset must name each row at most once")
    out_index = np.full(hi - lo, -1, np.int64)
    out_index[indices] = np.arange(len(indices))
    starts = np.asarray(firsts, np.int64) - lo  # position of each partition's row 0
    partition_of = np.searchsorted(starts, indices, side="right") - 1
    owner = np.asarray(home, np.int64)[partition_of] if len(indices) else np.empty(0, np.int64)
    assigned = assign_by_locality(owner, batch_size, drop, n)
    clipped = [(i, max(0, lo - f), min(r, hi - f)) for i, (r, f) in enumerate(zip(rows, firsts))]
    clipped = [(i, a, b) for i, a, b in clipped if b > a]
    reads: list[list[Read]] = []
    orders: list[np.ndarray] = []
    for rank in range(n):
        mine, arriving = [], []
        for i, a, b in clipped:
            first = firsts[i] - lo
            q = out_index[first + a : first + b]
            keep = q >= 0
            keep[keep] = assigned[q[keep]] == rank
            if keep.any():
                mine.append(Read(i, a, b, first, SelectedRows(first + a, keep)))
                arriving.append(q[keep])
        reads.append(mine)
        taken = np.concatenate(arriving) if arriving else np.empty(0, np.int64)
        orders.append(np.argsort(taken, kind="stable"))
    return reads, orders


def _taken(read: Read) -> int:
    if read.rule is None:
        return read.stop - read.start
    return int(read.rule.mask(read.first_position + np.arange(read.start, read.stop)).sum())


def _local_rows(source: Source, reads: list[Read]) -> LocalSource:
    """A replica's rows of a local source (``range``, ``from_tensor_slices``), cut on the client."""
    blocks = []
    for read in reads:
        block = source.load(source.partitions[read.partition])
        blocks.append(optree.tree_map(
            lambda leaf, r=read: select_rows(leaf, r.start, r.stop, r.first_position, r.rule), block))
    if not blocks:  # no rows for this replica: an empty block of the source's structure
        block = source.load(next(p for p in source.partitions))
        blocks.append(optree.tree_map(lambda leaf: leaf[:0], block))
    return LocalSource(ops.concat_blocks(blocks), num_partitions=1)


def _steps(parts: PipelineParts, exact_sizes: bool, used: int, batch_size: int, drop: bool,
           planned: list[PlannedRead], each: list[int], n: int) -> tuple[int | None, list[int | None]]:
    """Steps of one pass every replica runs (``None`` if not known), and each replica's own batches."""
    if any(not isinstance(op, _AFTER_OPS) for op in parts.after_ops):
        return None, [None] * n
    if exact_sizes:
        steps = len(global_batch_sizes(used, batch_size, drop))
        return steps, [steps] * n
    if parts.kind in ("unknown", "gathered"):  # a gather outside the global split: counts not worked out
        return None, [None] * n
    mine = [0] * n
    for read in planned:
        mine[read.replica] += read.rows
    per = [(m // max(e, 1) if drop else -(-m // max(e, 1))) for m, e in zip(mine, each)]
    return max(per, default=0), list[int | None](per)
