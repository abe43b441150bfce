"""Single-copy all-reduce among replicas of one host: each replica reads its peers' arrays in place.

The shared-memory ring copies every byte twice (into a channel slot, out of
it). Linux can copy straight from another process's memory
(``process_vm_readv``, "cross memory attach", what MPI's shared-memory
transports use for large messages), so a large all-reduce needs one copy:

1. every replica sends its peers the addresses of its input and result
   arrays (one small message over the shared-memory channels);
2. reduce-scatter: replica ``r`` owns chunk ``r``; it reads that chunk of
   every peer's input in pieces that stay in its cache and reduces them in
   rank order into its result (each element reduced once, by its owner, in
   one fixed order: every replica ends with the same bits);
3. all-gather: once a peer says its chunk is done, the replica copies that
   chunk from the peer's result straight into its own;
4. a last message says "I have finished reading you": no replica returns
   (and lets its caller reuse the arrays) while a peer may still read them.

Whether the kernel lets the replicas read each other (``ptrace`` rules,
containers, other operating systems) is probed once per group, on the first
all-reduce that could use this path: every replica reads a token from every
peer and they agree (another message) to use it only if every read worked,
and on the size from which to use it (the largest of the replicas'
values of ``daskdist.collective.shm.single-copy-bytes``, read on the client
when the strategy is made). Otherwise the ring through the channels stays in
use.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from typing import Any

import numpy as np

from daskdist import config
from daskdist.collective.core.call import Call
from daskdist.collective.core.reduction import combine_into, finalize
from daskdist.collective.core.settings import parse_single_copy_bytes
from daskdist.exceptions import DaskdistError, ReplicaLostError
from daskdist.ops import ReduceOp

__all__ = ["CrossMemory", "SingleCopyAllReduce", "cross_memory", "single_copy_bytes"]

logger = logging.getLogger(__name__)

#: bytes of a peer's input read and reduced at a time: small enough to stay in a core's L2 cache
PIECE_BYTES = 256 << 10
#: chunk boundaries fall on multiples of this many bytes (whole pages, no cache line shared by two owners)
_CHUNK_ALIGN = 4096


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class CrossMemory:
    """Reads another process's memory with ``process_vm_readv`` (Linux 3.2+); the GIL is released meanwhile."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
        readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                          ctypes.c_ulong, ctypes.c_ulong]
        readv.restype = ctypes.c_ssize_t
        self._readv = readv

    def read(self, pid: int, address: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``address`` in process ``pid`` into the contiguous array ``out``.

        Raises
        ------
        OSError
            The kernel refused or the memory is not there (``errno`` says why).
        """
        total = out.nbytes
        if total == 0:
            return
        base = out.ctypes.data
        done = 0
        local, remote = _IoVec(), _IoVec()
        while done < total:  # the kernel may stop early (partial reads across page boundaries)
            local.iov_base, local.iov_len = base + done, total - done
            remote.iov_base, remote.iov_len = address + done, total - done
            got = self._readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                code = ctypes.get_errno() if got < 0 else errno.EFAULT
                raise OSError(code, f"process_vm_readv from process {pid}: {os.strerror(code)}")
            done += got


_CROSS_MEMORY: list[CrossMemory | None] = []


def cross_memory() -> CrossMemory | None:
    """The process-wide ``CrossMemory``, or ``None`` where the system has no ``process_vm_readv``."""
    if not _CROSS_MEMORY:
        reader = None
        if sys.platform.startswith("linux"):
            try:
                reader = CrossMemory()
            except (OSError, AttributeError) as e:  # pragma: no cover - an old or unusual libc
                logger.debug("No process_vm_readv: %s", e)
        _CROSS_MEMORY.append(reader)
    return _CROSS_MEMORY[0]


def single_copy_bytes() -> int | None:
    """``daskdist.collective.shm.single-copy-bytes`` in bytes; ``None`` when switched off (null, 0 or false)."""
    return parse_single_copy_bytes(config.get("collective.shm.single-copy-bytes"))


def chunk_bounds(nbytes: int, itemsize: int, size: int) -> list[int]:
    """Element offsets splitting ``nbytes`` into ``size`` chunks on ``_CHUNK_ALIGN``-byte boundaries."""
    align = max(1, _CHUNK_ALIGN // itemsize) if _CHUNK_ALIGN % itemsize == 0 else 1
    elements = nbytes // itemsize
    blocks = -(-elements // align)
    bounds = [min(elements, (blocks * r // size) * align) for r in range(size)]
    return [*bounds, elements]


class SingleCopyAllReduce:
    """The single-copy all-reduce of one communicator whose peers all share its host (module docstring).

    Parameters
    ----------
    min_bytes
        All-reduces of at least this many bytes take this path (the peers
        agree on the largest of their values); ``None``: never, on any replica.
    """

    def __init__(self, min_bytes: int | None):
        self.pid = os.getpid()
        self.min_bytes = min_bytes
        # None: not probed yet. Probed even when switched off here: the peers learn it from the probe,
        # so every replica of the group decides the same way.
        self.usable: bool | None = None
        self.reader = cross_memory()
        self._token = np.frombuffer(os.urandom(16), np.uint64).copy()
        self._scratch: list[np.ndarray] = []

    def wants(self, nbytes: int) -> bool:
        """Whether a ring all-reduce of ``nbytes`` should try this path (decided alike on every replica)."""
        if self.usable is None:
            return True  # the first candidate probes, on every replica alike
        return self.usable and self.min_bytes is not None and nbytes >= self.min_bytes

    # -- probing -------------------------------------------------------------------

    def probe(self, call: Call) -> bool:
        """Find out, together with the peers, whether every replica can read every other; cached."""
        if self.usable is not None:
            return self.usable
        peers = [p for p in range(call.size) if p != call.rank]
        mine = np.array([self.pid, self._token.ctypes.data, int(self._token[0]), int(self._token[1]),
                         self.min_bytes or 0], np.uint64)
        handles = [call.send(p, "cma-probe", mine) for p in peers]
        reader = self.reader
        readable = reader is not None
        reason = "" if readable else "no process_vm_readv on this system"
        thresholds = [self.min_bytes or 0]
        for p in peers:
            theirs = call.recv(p, "cma-probe", expect=5)
            thresholds.append(int(theirs[4]))
            if not readable or reader is None:
                continue
            seen = np.empty(2, np.uint64)
            try:
                reader.read(int(theirs[0]), int(theirs[1]), seen)
            except OSError as e:
                readable, reason = False, f"reading replica {p}: {e}"
                continue
            if int(seen[0]) != int(theirs[2]) or int(seen[1]) != int(theirs[3]):
                readable, reason = False, f"replica {p}'s memory is not where it said (another pid namespace?)"
        handles += [call.send(p, "cma-agree", np.array([readable], np.uint8)) for p in peers]
        agreed = readable
        for p in peers:
            agreed = bool(call.recv(p, "cma-agree", expect=1)[0]) and agreed
        for h in handles:
            call.wait(h)
        if agreed and all(thresholds):
            self.usable, self.min_bytes = True, max(thresholds)
            logger.debug("Replica %d: single-copy all-reduce from %d bytes", call.rank, self.min_bytes)
        else:
            self.usable = False
            logger.info("Replica %d: single-copy all-reduce not used (%s)", call.rank,
                        reason or ("switched off on some replica" if agreed else "a peer cannot read this replica"))
        return self.usable

    # -- the all-reduce ------------------------------------------------------------

    def allreduce(self, call: Call, buf: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        """All-reduce the flat contiguous ``buf`` into ``out`` (``None``: in place); every replica calls this."""
        size, rank = call.size, call.rank
        target = buf if out is None else out
        flat_in, flat_out = buf.reshape(-1), target.reshape(-1)
        peers = [(rank + k) % size for k in range(1, size)]
        mine = np.array([self.pid, flat_in.ctypes.data, flat_out.ctypes.data, buf.nbytes], np.uint64)
        handles = [call.send(p, "cma-addr", mine) for p in peers]
        where: dict[int, tuple[int, int, int]] = {}
        for p in reversed(peers):
            theirs = call.recv(p, "cma-addr", expect=4)
            if int(theirs[3]) != buf.nbytes:
                call.mismatch(f"replica {p} all-reduces {int(theirs[3])} bytes where replica {rank} has {buf.nbytes}")
            where[p] = (int(theirs[0]), int(theirs[1]), int(theirs[2]))
        bounds = chunk_bounds(buf.nbytes, buf.dtype.itemsize, size)
        lo, hi = bounds[rank], bounds[rank + 1]
        self._reduce_chunk(call, flat_in, flat_out, lo, hi, op, where)
        handles += [call.send(p, "cma-done", b"") for p in peers]
        for p in reversed(peers):
            call.recv(p, "cma-done")
            pid, _, result_address = where[p]
            start, stop = bounds[p], bounds[p + 1]
            self._read(call, p, pid, result_address + start * buf.dtype.itemsize, flat_out[start:stop])
        handles += [call.send(p, "cma-fin", b"") for p in peers]
        for p in reversed(peers):
            call.recv(p, "cma-fin")
        for h in handles:
            call.wait(h)
        return target

    def _reduce_chunk(self, call: Call, flat_in: np.ndarray, flat_out: np.ndarray, lo: int, hi: int,
                      op: ReduceOp, where: dict[int, tuple[int, int, int]]) -> None:
        """``flat_out[lo:hi]`` = the reduction over the replicas (rank order) of their inputs' ``[lo:hi]``."""
        itemsize = flat_in.dtype.itemsize
        step = max(1, PIECE_BYTES // itemsize)
        base_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
        in_place = flat_in.ctypes.data == flat_out.ctypes.data
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            acc = flat_out[a:b]
            first = None
            own = flat_in[a:b]
            if in_place and call.rank >= 2:  # acc is own: it changes before own's turn comes
                own = self._scratch_view(2, flat_in.dtype, b - a)
                np.copyto(own, flat_in[a:b])
            for r in range(call.size):
                if r == call.rank:
                    term = own
                else:  # rank 0's piece waits in scratch 0 until rank 1's arrives (in scratch 1)
                    term = self._scratch_view(0 if r == 0 else 1, flat_in.dtype, b - a)
                    pid, input_address, _ = where[r]
                    self._read(call, r, pid, input_address + a * itemsize, term)
                if r == 0:
                    first = term
                else:
                    combine_into(base_op, acc, term, first if r == 1 else None)
        finalize(op, flat_out[lo:hi], call.size)

    def _scratch_view(self, index: int, dtype: Any, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        while len(self._scratch) <= index:
            self._scratch.append(np.empty(0, np.uint8))
        if self._scratch[index].nbytes < nbytes:
            self._scratch[index] = np.empty(max(nbytes, PIECE_BYTES), np.uint8)
        return self._scratch[index][:nbytes].view(dtype)

    def _read(self, call: Call, peer: int, pid: int, address: int, out: np.ndarray) -> None:
        if self.reader is None:  # the probe agrees on this path only where every replica has a reader
            raise DaskdistError("single-copy all-reduce: this system has no process_vm_readv")
        try:
            self.reader.read(pid, address, out)
        except OSError as e:
            if e.errno == errno.ESRCH:
                raise ReplicaLostError(f"replica {peer} (process {pid}) is gone: reading its array failed") from e
            raise DaskdistError(f"single-copy all-reduce: reading replica {peer}'s array failed: {e}") from e

