"""Reusable result buffers for large collectives.

A fresh numpy array above glibc's mmap threshold (128 KiB; Dask's nanny sets
``MALLOC_TRIM_THRESHOLD_``, which keeps that threshold from adapting) is a
fresh mapping: a page fault and the kernel's zeroing for every page its first
write touches, and an ``munmap`` with TLB shootdowns when it is freed. For a
256 KiB all-reduce that was most of its time; for 64 MiB a noticeable share. A training step all-reduces
same-sized gradient packs every step and drops the previous step's results,
so ``BufferPool`` hands out arrays that nobody holds any more.

"Nobody holds it" is read from the reference count: results returned to the
caller are views whose ``base`` is the pooled array, so while any of them (or
anything derived from them) is alive, the array's count stays above the
pool's own references and it is not reused.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

__all__ = ["BufferPool"]

#: references to a pooled array while only the pool holds it: the pool's list, the loop variable,
#: and ``sys.getrefcount``'s own argument
_IDLE_REFCOUNT = 3


class BufferPool:
    """A few numpy buffers kept between collectives, handed out again once unreferenced.

    Parameters
    ----------
    min_bytes
        Smaller requests get a fresh array (allocation is cheap there).
    max_buffers
        How many buffers the pool keeps; the oldest idle one is dropped beyond that.
    """

    def __init__(self, min_bytes: int = 1 << 17, max_buffers: int = 8):
        self.min_bytes = min_bytes
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()  # collectives in flight together (an async window) take buffers at once

    def empty(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """An uninitialised 1-D or n-d array, reused from the pool when one of the right size is idle."""
        if isinstance(shape, int):
            shape = (shape,)
        kind: np.dtype[Any] = np.dtype(dtype)
        nbytes = kind.itemsize
        for d in shape:
            nbytes *= d
        if nbytes < self.min_bytes:
            return np.empty(shape, kind)
        with self._lock:  # the view handed out holds the buffer before another thread looks at its count
            for buffer in self._buffers:
                if buffer.nbytes == nbytes and sys.getrefcount(buffer) <= _IDLE_REFCOUNT:
                    return buffer.view(kind).reshape(shape)
            buffer = np.empty(nbytes, np.uint8)
            self._buffers.append(buffer)
            if len(self._buffers) > self.max_buffers:
                self._drop_one_idle()
            return buffer.view(kind).reshape(shape)

    def empty_like(self, array: np.ndarray) -> np.ndarray:
        """``empty(array.shape, array.dtype)``."""
        return self.empty(array.shape, array.dtype)

    def _drop_one_idle(self) -> None:
        buffers = self._buffers
        for index in range(len(buffers)):
            # references while idle: the list, and getrefcount's argument
            if sys.getrefcount(buffers[index]) <= _IDLE_REFCOUNT - 1:
                del buffers[index]  # by position: ``list.remove`` would compare arrays element-wise
                return
        buffers.pop(0)  # all in use: forget the oldest (its holders keep it alive)

    def clear(self) -> None:
        """Forget every buffer."""
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)
