"""The element-level transformations of a ``Dataset``, each a step over a Python iterator.

Every op turns an iterator of elements into another, given the ``PipelineState``
of the iteration (epoch, replica, the cache store). Elements are nested
structures (``optree``) of arrays or numbers.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import optree

from daskdist.arrays import namespace

__all__ = [
    "Batch",
    "Cache",
    "Filter",
    "Map",
    "Op",
    "PipelineState",
    "Prefetch",
    "Repeat",
    "Shard",
    "Shuffle",
    "Skip",
    "Take",
    "Unbatch",
    "stack_elements",
]


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
    caches: dict[int, list] = field(default_factory=dict)


class Op:
    """One transformation; ``apply`` wraps an upstream iterator factory."""

    def apply(self, upstream: Callable[[PipelineState], Iterator[Any]], state: PipelineState) -> Iterator[Any]:
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

    def apply(self, upstream, state):
        return (_call(self.fn, element) for element in upstream(state))

    def describe(self) -> str:
        return f"map({getattr(self.fn, '__name__', 'fn')})"


class Filter(Op):
    def __init__(self, predicate: Callable[..., Any]):
        if not callable(predicate):
            raise TypeError(f"filter needs a callable, got {type(predicate).__name__}")
        self.predicate = predicate

    def apply(self, upstream, state):
        return (element for element in upstream(state) if bool(_call(self.predicate, element)))


def stack_elements(elements: list[Any]) -> Any:
    """Stack elements along a new leading axis (a batch)."""
    leaves = [optree.tree_flatten(e, none_is_leaf=True) for e in elements]
    treedef = leaves[0][1]
    columns = zip(*(flat for flat, _ in leaves))
    stacked = []
    for column in columns:
        first = column[0]
        xp = namespace(first) if hasattr(first, "shape") else np
        stacked.append(xp.stack([xp.asarray(c) for c in column]))
    return optree.tree_unflatten(treedef, stacked)


class Batch(Op):
    def __init__(self, batch_size: int, drop_remainder: bool = False):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.batch_size = int(batch_size)
        self.drop_remainder = drop_remainder

    def apply(self, upstream, state):
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


class Unbatch(Op):
    def apply(self, upstream, state):
        for batch in upstream(state):
            leaves, treedef = optree.tree_flatten(batch, none_is_leaf=True)
            rows = len(leaves[0]) if leaves else 0
            for i in range(rows):
                yield optree.tree_unflatten(treedef, [leaf[i] for leaf in leaves])


class Shuffle(Op):
    """TF's buffer shuffle: keep ``buffer_size`` elements, emit a random one, refill."""

    def __init__(self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True):
        if not isinstance(buffer_size, (int, np.integer)) or buffer_size < 1:
            raise ValueError(f"buffer_size must be a positive int, got {buffer_size!r}")
        self.buffer_size = int(buffer_size)
        self.seed = seed
        self.reshuffle_each_iteration = reshuffle_each_iteration

    def apply(self, upstream, state):
        epoch = state.epoch if self.reshuffle_each_iteration else 0
        rng = np.random.default_rng(None if self.seed is None else [self.seed, epoch, state.replica])
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


class Cache(Op):
    """Keep the elements of the first complete pass in memory; later passes replay them."""

    def apply(self, upstream, state):
        key = id(self)
        cached = state.caches.get(key)
        if cached is not None:
            yield from cached
            return
        filling: list[Any] = []
        for element in upstream(state):
            filling.append(element)
            yield element
        state.caches[key] = filling  # only a complete pass is kept


class Repeat(Op):
    def __init__(self, count: int | None = None):
        if count is not None and count < -1:
            raise ValueError(f"repeat count must be None, -1 or >= 0, got {count}")
        self.count = None if count in (None, -1) else int(count)

    def apply(self, upstream, state):
        done = 0
        while self.count is None or done < self.count:
            produced = False
            for element in upstream(state):
                produced = True
                yield element
            done += 1
            state.epoch += 1
            if not produced:  # an empty dataset repeated forever is still empty
                return


class Take(Op):
    def __init__(self, count: int):
        self.count = int(count)

    def apply(self, upstream, state):
        if self.count < 0:
            yield from upstream(state)
            return
        for i, element in enumerate(upstream(state)):
            if i >= self.count:
                return
            yield element


class Skip(Op):
    def __init__(self, count: int):
        self.count = int(count)

    def apply(self, upstream, state):
        for i, element in enumerate(upstream(state)):
            if self.count < 0 or i >= self.count:
                if self.count >= 0:
                    yield element


class Shard(Op):
    """Keep every ``num_shards``-th element starting at ``index`` (TF's ``shard``)."""

    def __init__(self, num_shards: int, index: int):
        if num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(f"shard needs num_shards >= 1 and 0 <= index < num_shards, got ({num_shards}, {index})")
        self.num_shards = int(num_shards)
        self.index = int(index)

    def apply(self, upstream, state):
        for i, element in enumerate(upstream(state)):
            if i % self.num_shards == self.index:
                yield element

    def describe(self) -> str:
        return f"shard({self.num_shards}, {self.index})"


class Prefetch(Op):
    """Produce up to ``buffer_size`` elements ahead in a background thread."""

    def __init__(self, buffer_size: int | None = None):
        self.buffer_size = max(1, int(buffer_size or 1))

    def apply(self, upstream, state):
        return _PrefetchIterator(upstream(state), self.buffer_size)


_DONE = object()


class _PrefetchIterator:
    def __init__(self, source: Iterator[Any], depth: int):
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), daemon=True, name="daskdist-prefetch")
        self._thread.start()

    def _fill(self, source: Iterator[Any]) -> None:
        try:
            for element in source:
                while not self._stop.is_set():
                    try:
                        self._queue.put((element, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._put((_DONE, None))
        except BaseException as e:  # raised again in the consumer
            self._put((_DONE, e))

    def _put(self, item: tuple) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> _PrefetchIterator:
        return self

    def __next__(self) -> Any:
        element, error = self._queue.get()
        if element is _DONE:
            self._stop.set()
            if error is not None:
                raise error
            raise StopIteration
        return element

    def close(self) -> None:
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()
