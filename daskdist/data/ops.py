"""The transformations of a ``Dataset``, vectorised over blocks of rows.

Until the first ``batch``, a pipeline carries *blocks*: structures of
arrays whose leading axis holds many rows (a partition, or a slice of one).
Each op works on whole blocks with numpy (or cupy): a shuffle draws rows
from a buffer block, a batch slices rows out, a cache keeps blocks. Only
``map`` and ``filter`` call the user's function once per row (TF's
semantics), and their results are stacked back into blocks; put ``cache()``
after them and later epochs never call them again. After ``batch`` the
pipeline carries elements (the batches) and the ops work per element;
``unbatch`` turns elements back into blocks.

Every op has ``apply_rows`` (blocks in, blocks out) and ``apply_elements``
(elements in, elements out); ``Batch`` and ``Unbatch`` switch between them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optree

from daskdist.arrays import namespace

__all__ = [
    "Batch",
    "Cache",
    "Filter",
    "Gather",
    "Map",
    "Op",
    "PipelineState",
    "Prefetch",
    "Repeat",
    "Shard",
    "Shuffle",
    "Skip",
    "SplitBatch",
    "Take",
    "Unbatch",
    "block_rows",
    "concat_blocks",
    "slice_block",
    "stack_elements",
]

Stream = Callable[["PipelineState"], Iterator[Any]]


@dataclass
class PipelineState:
    """What the ops of one iteration share.

    Attributes
    ----------
    epoch
        Counts passes over the data (``repeat`` and new iterators), for reshuffling.
    replica
        The replica iterating (0 on the client), so each replica shuffles differently.
    caches
        Filled caches by op id; kept by the owner of the dataset across iterators.
    """

    epoch: int = 0
    replica: int = 0
    caches: dict[int, list[Any]] = field(default_factory=dict)


# -- blocks ----------------------------------------------------------------------------


def block_rows(block: Any) -> int:
    leaves = optree.tree_leaves(block, none_is_leaf=False)
    return int(leaves[0].shape[0]) if leaves else 0


def slice_block(block: Any, index: Any) -> Any:
    return optree.tree_map(lambda leaf: leaf[index], block)


def concat_blocks(blocks: list[Any]) -> Any:
    if len(blocks) == 1:
        return blocks[0]
    flat = [optree.tree_flatten(b) for b in blocks]
    treedef = flat[0][1]
    columns = zip(*(leaves for leaves, _ in flat))
    return optree.tree_unflatten(treedef, [namespace(c[0]).concatenate(c) for c in columns])


def rows_of_block(block: Any) -> Iterator[Any]:
    leaves, treedef = optree.tree_flatten(block)
    n = int(leaves[0].shape[0]) if leaves else 0
    return (optree.tree_unflatten(treedef, [leaf[i] for leaf in leaves]) for i in range(n))


def stack_elements(elements: list[Any]) -> Any:
    """Stack elements along a new leading axis (a batch, or a block of rows)."""
    leaves = [optree.tree_flatten(e, none_is_leaf=True) for e in elements]
    treedef = leaves[0][1]
    stacked = []
    for column in zip(*(flat for flat, _ in leaves)):
        first = column[0]
        xp = namespace(first) if hasattr(first, "shape") else np
        stacked.append(xp.stack([xp.asarray(c) for c in column]))
    return optree.tree_unflatten(treedef, stacked)


# -- ops -------------------------------------------------------------------------------


class Op:
    """One transformation."""

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        raise NotImplementedError

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__.lower()


def _call(fn: Callable[..., Any], element: Any) -> Any:
    """Tuples are unpacked into arguments, as ``tf.data.Dataset.map`` does."""
    if isinstance(element, tuple) and not hasattr(element, "_fields"):
        return fn(*element)
    return fn(element)


class Map(Op):
    def __init__(self, fn: Callable[..., Any]):
        if not callable(fn):
            raise TypeError(f"map needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        for block in upstream(state):
            if block_rows(block):
                yield stack_elements([_call(self.fn, row) for row in rows_of_block(block)])

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        return (_call(self.fn, element) for element in upstream(state))

    def describe(self) -> str:
        return f"map({getattr(self.fn, '__name__', 'fn')})"


class Filter(Op):
    def __init__(self, predicate: Callable[..., Any]):
        if not callable(predicate):
            raise TypeError(f"filter needs a callable, got {type(predicate).__name__}")
        self.predicate = predicate

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        for block in upstream(state):
            keep = np.fromiter((bool(_call(self.predicate, row)) for row in rows_of_block(block)), dtype=bool)
            if keep.any():
                yield slice_block(block, keep)

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        return (element for element in upstream(state) if bool(_call(self.predicate, element)))


class Batch(Op):
    def __init__(self, batch_size: int, drop_remainder: bool = False):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.batch_size = int(batch_size)
        self.drop_remainder = drop_remainder

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        """Blocks in, batches (elements) out: views into the blocks, copies only across block edges."""
        pieces: list[Any] = []  # parts of the batch being assembled
        have = 0
        for block in upstream(state):
            n = block_rows(block)
            start = 0
            while start < n:
                take = min(self.batch_size - have, n - start)
                pieces.append(slice_block(block, slice(start, start + take)))
                have += take
                start += take
                if have == self.batch_size:
                    yield concat_blocks(pieces)
                    pieces, have = [], 0
        if have and not self.drop_remainder:
            yield concat_blocks(pieces)

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        pending: list[Any] = []
        for element in upstream(state):
            pending.append(element)
            if len(pending) == self.batch_size:
                yield stack_elements(pending)
                pending = []
        if pending and not self.drop_remainder:
            yield stack_elements(pending)

    def describe(self) -> str:
        return f"batch({self.batch_size}{', drop_remainder' if self.drop_remainder else ''})"


class SplitBatch(Batch):
    """One replica's part of each global batch: batches of the given sizes, in order, then nothing.

    A distributed dataset replaces the global ``batch`` with this on each
    replica; a size of 0 gives an empty batch (0 rows, same structure), so
    every replica yields one element per global batch, also across ``repeat``.
    """

    def __init__(self, sizes: list[int], drop_remainder: bool = False):
        super().__init__(max(max(sizes, default=1), 1), drop_remainder)
        self.sizes = [int(s) for s in sizes]

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        blocks = iter(upstream(state))
        block, start, seen = None, 0, None
        for size in self.sizes:
            pieces: list[Any] = []
            have = 0
            while have < size:
                if block is None or start >= block_rows(block):
                    block = next(blocks, None)
                    start = 0
                    if block is None:
                        break
                    seen = block
                take = min(size - have, block_rows(block) - start)
                pieces.append(slice_block(block, slice(start, start + take)))
                have += take
                start += take
            if pieces:
                yield concat_blocks(pieces)
            elif seen is not None:  # this replica's part of the batch is empty
                yield slice_block(seen, slice(0, 0))
            else:
                return  # no rows at all: the iterator hands out empty batches from the element spec

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        raise ValueError("a split batch needs rows, not batches")

    def describe(self) -> str:
        return f"split_batch({self.sizes[:4]}{'...' if len(self.sizes) > 4 else ''})"


class Unbatch(Op):
    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        """Elements (batches) in, blocks out."""
        for batch in upstream(state):
            if block_rows(batch):
                yield batch

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        raise ValueError("unbatch() needs a batched dataset")


class Shuffle(Op):
    """TF's buffer shuffle: keep ``buffer_size`` rows, emit random ones as new rows arrive.

    On blocks: each arriving block is appended to the buffer and as many rows
    as it brought are drawn at random from the buffer (each output row is
    uniform over the current buffer, as in the row-by-row algorithm).
    """

    def __init__(self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True):
        if not isinstance(buffer_size, (int, np.integer)) or buffer_size < 1:
            raise ValueError(f"buffer_size must be a positive int, got {buffer_size!r}")
        self.buffer_size = int(buffer_size)
        self.seed = seed
        self.reshuffle_each_iteration = reshuffle_each_iteration

    def _rng(self, state: PipelineState) -> np.random.Generator:
        epoch = state.epoch if self.reshuffle_each_iteration else 0
        return np.random.default_rng(None if self.seed is None else [self.seed, epoch, state.replica])

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        rng = self._rng(state)
        buffer = None
        for block in upstream(state):
            buffer = block if buffer is None else concat_blocks([buffer, block])
            size = block_rows(buffer)
            if size <= self.buffer_size:
                continue
            chosen = rng.choice(size, size - self.buffer_size, replace=False)
            keep = np.ones(size, bool)
            keep[chosen] = False
            yield from _gather_in_chunks(buffer, chosen)
            buffer = slice_block(buffer, keep)
        if buffer is not None and block_rows(buffer):
            yield from _gather_in_chunks(buffer, rng.permutation(block_rows(buffer)))

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        rng = self._rng(state)
        buffer: list[Any] = []
        for element in upstream(state):
            if len(buffer) < self.buffer_size:
                buffer.append(element)
                continue
            i = int(rng.integers(len(buffer)))
            buffer[i], element = element, buffer[i]
            yield element
        rng.shuffle(buffer)
        yield from buffer

    def describe(self) -> str:
        return f"shuffle({self.buffer_size})"


class Gather(Op):
    """Rows in a given order: output row ``i`` is the pass's upstream row ``indices[i]`` (rows not named are dropped).

    Not a ``tf.data`` transformation: elastic training (``daskdist.elastic``)
    turns a ``shuffle`` before the batch into a ``Gather`` of a seeded
    permutation of the epoch's rows, which the planner can split by global
    batch (``data/planner.py``) and re-plan from any row after a loss. It holds
    every upstream row of a pass in memory before emitting the first.
    """

    def __init__(self, indices: Any):
        indices = np.asarray(indices)
        if indices.ndim != 1 or (indices.size and (indices.dtype.kind not in "iu" or indices.min() < 0)):
            raise ValueError("gather needs a 1-d array of non-negative row indices")
        self.indices = indices.astype(np.int64, copy=False)

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        blocks = [block for block in upstream(state) if block_rows(block)]
        if not blocks:
            if len(self.indices):
                raise IndexError(f"gather of {len(self.indices)} rows from an empty pass")
            return
        block = concat_blocks(blocks)
        if len(self.indices) and int(self.indices.max()) >= block_rows(block):
            raise IndexError(f"gather index {int(self.indices.max())} out of range for {block_rows(block)} rows")
        yield from _gather_in_chunks(block, self.indices)

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        raise ValueError("gather reorders rows: put it before the batch")

    def describe(self) -> str:
        return f"gather({len(self.indices)} rows)"


_GATHER_ROWS = 2048


def _gather_in_chunks(block: Any, order: np.ndarray) -> Iterator[Any]:
    """``block[order]`` as a sequence of smaller blocks (random gathers stay cache-sized)."""
    for start in range(0, len(order), _GATHER_ROWS):
        yield slice_block(block, order[start : start + _GATHER_ROWS])


class Cache(Op):
    """Keep what the first complete pass produced (blocks or elements); later passes replay it."""

    def _apply(self, upstream: Stream, state: PipelineState, consolidate: bool) -> Iterator[Any]:
        key = id(self)
        cached = state.caches.get(key)
        if cached is not None:
            yield from cached
            return
        filling: list[Any] = []
        for item in upstream(state):
            filling.append(item)
            yield item
        if consolidate and len(filling) > 1:  # one block per cache: later epochs slice it, no per-row work
            filling = [concat_blocks(filling)]
        state.caches[key] = filling  # only a complete pass is kept

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        return self._apply(upstream, state, consolidate=True)

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        return self._apply(upstream, state, consolidate=False)


class Repeat(Op):
    def __init__(self, count: int | None = None):
        if count is not None and count < -1:
            raise ValueError(f"repeat count must be None, -1 or >= 0, got {count}")
        self.count = None if count in (None, -1) else int(count)

    def _apply(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        done = 0
        while self.count is None or done < self.count:
            produced = False
            for item in upstream(state):
                produced = True
                yield item
            done += 1
            state.epoch += 1
            if not produced:  # an empty dataset repeated forever is still empty
                return

    apply_rows = _apply
    apply_elements = _apply


class _Counted(Op):
    """Base of take/skip/shard: decide per row (in blocks) or per element by its position."""

    def keep(self, index: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def done(self, position: int) -> bool:
        return False

    def apply_rows(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        position = 0
        for block in upstream(state):
            n = block_rows(block)
            mask = self.keep(np.arange(position, position + n))
            position += n
            if mask.all():
                yield block
            elif mask.any():
                yield slice_block(block, mask)
            if self.done(position):
                return

    def apply_elements(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        for position, element in enumerate(upstream(state)):
            if self.keep(np.array([position]))[0]:
                yield element
            if self.done(position + 1):
                return


class Take(_Counted):
    def __init__(self, count: int):
        self.count = int(count)

    def keep(self, index: np.ndarray) -> np.ndarray:
        return index < self.count if self.count >= 0 else np.ones(len(index), bool)

    def done(self, position: int) -> bool:
        return 0 <= self.count <= position


class Skip(_Counted):
    def __init__(self, count: int):
        self.count = int(count)

    def keep(self, index: np.ndarray) -> np.ndarray:
        return index >= self.count if self.count >= 0 else np.zeros(len(index), bool)


class Shard(_Counted):
    """Keep every ``num_shards``-th element starting at ``index`` (TF's ``shard``)."""

    def __init__(self, num_shards: int, index: int):
        if num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(f"shard needs num_shards >= 1 and 0 <= index < num_shards, got ({num_shards}, {index})")
        self.num_shards = int(num_shards)
        self.index = int(index)

    def keep(self, index: np.ndarray) -> np.ndarray:
        mine: np.ndarray = index % self.num_shards == self.index
        return mine

    def describe(self) -> str:
        return f"shard({self.num_shards}, {self.index})"


class Prefetch(Op):
    """Produce up to ``buffer_size`` items ahead in a background thread."""

    def __init__(self, buffer_size: int | None = None):
        self.buffer_size = max(1, int(buffer_size or 1))

    def _apply(self, upstream: Stream, state: PipelineState) -> Iterator[Any]:
        return PrefetchIterator(upstream(state), self.buffer_size)

    apply_rows = _apply
    apply_elements = _apply


_DONE = object()


class PrefetchIterator:
    """Runs ``source`` in a background thread, ``depth`` items ahead; ``close()`` stops it."""

    def __init__(self, source: Iterator[Any], depth: int):
        self._queue: queue.Queue[Any] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), daemon=True, name="daskdist-prefetch")
        self._thread.start()

    def _fill(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                if not self._put((item, None)):
                    return
            self._put((_DONE, None))
        except BaseException as e:  # raised again in the consumer
            self._put((_DONE, e))

    def _put(self, item: tuple[Any, ...]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        item, error = self._queue.get()
        if item is _DONE:
            self._stop.set()
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
