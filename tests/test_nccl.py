"""The NCCL path for GPU (cupy) replica groups (``daskdist/collective/core/engines/nccl/engine.py``).

Two parts:

* CPU unit tests of the engine's own logic (dtype/op mapping, which collectives
  take NCCL, packing, polling with deadlines and aborts, communicator
  re-creation, the scheduler's keyed exchange). They drive real
  ``Communicator`` objects over the in-memory transport of ``tests/fakes.py``
  with a fake of ``cupy.cuda.nccl``: ``FakeNccl`` has cupy's constants (values
  of ``cupy_backends/cuda/libs/nccl.pxd``) and an ``NcclCommunicator`` with
  cupy's method signatures (raw pointers, counts, type and op codes, stream
  pointer) that reads and writes numpy memory through those pointers and
  completes an operation only once every rank has issued it. These say
  nothing about real multi-GPU behaviour.
* GPU tests (marked ``gpu``) on a real two-worker cluster with one GPU per
  worker; skipped where there is no cupy, no NCCL or fewer than 2 GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import sys
import threading
import time
import types
from typing import Any

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.cluster.embedded import local_gpu_count
from daskdist.collective.core.communicator import Algorithm
from daskdist.collective.core.engines.nccl import support as nccl_support
from daskdist.collective.core.engines.nccl.engine import CupyDevice, NcclEngine, engine_for_group
from daskdist.collective.core.engines.nccl.support import group_features, nccl_dtype_name, nccl_op_name, parse_setting
from daskdist.collective.mailbox import Abort, MailboxTimeout
from daskdist.exceptions import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ReplicaLostError,
)
from daskdist.group.scheduler_plugin import DaskdistSchedulerPlugin, GroupState
from daskdist.ops import CommunicationOptions, ReduceOp

from .fakes import InMemoryGroup
from .reference import NUMPY_OPS, random_inputs
from .support.killers import RunInBackground, worker_pid

# -- a fake of cupy.cuda.nccl ---------------------------------------------------------------

#: cupy's constants (cupy_backends/cuda/libs/nccl.pxd), which are NCCL's enum values
CONSTANTS = {
    "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4,
    "NCCL_INT8": 0, "NCCL_CHAR": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT": 2, "NCCL_UINT32": 3,
    "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_HALF": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT": 7,
    "NCCL_FLOAT64": 8, "NCCL_DOUBLE": 8,
}
#: how NCCL itself reads those codes
TYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
         7: np.float32, 8: np.float64}
UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}


class FakeNcclError(RuntimeError):
    pass


def _memory(ptr: int, count: int, code: int) -> np.ndarray:
    dtype = np.dtype(TYPES[code])
    raw = (ctypes.c_ubyte * (count * dtype.itemsize)).from_address(ptr)
    return np.ctypeslib.as_array(raw).view(dtype)


class FakeOp:
    def __init__(self, kind: str, args: tuple):
        self.kind, self.args = kind, args
        self.done = False


class FakeStream:
    def __init__(self) -> None:
        self.ops: list[FakeOp] = []


class FakeEvent:
    def __init__(self, ready):
        self.ready = ready


#: every world made by the running test (released afterwards)
WORLDS: list[FakeNcclWorld] = []


class FakeNcclWorld:
    """The GPUs of a fake group: unique ids, blocking set-up, collectives done once every rank issued them."""

    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.ids: list[tuple] = []
        self.inits: dict[tuple, list[int]] = {}
        self.comms: list[FakeComm] = []
        self.calls: list[tuple] = []  # (rank, method, datatype code, op code or None, count)
        self.pending: dict[tuple, dict[int, FakeOp]] = {}
        self.streams: dict[int, FakeStream] = {}
        self.never_init: set[int] = set()  # ranks whose NcclCommunicator(...) never returns (until release)
        self.fail_next = False  # the next completed collective reports an asynchronous error
        self.released = False
        self.module = types.SimpleNamespace(available=True, get_unique_id=self.get_unique_id,
                                            NcclCommunicator=self._communicator, **CONSTANTS)
        self._counter = itertools.count()
        WORLDS.append(self)

    def get_unique_id(self) -> tuple:
        n = next(self._counter)
        uid = tuple(((n * 31 + i) % 256) - 128 for i in range(128))
        self.ids.append(uid)
        return uid

    def _communicator(self, size: int, uid: Any, rank: int) -> FakeComm:
        # cupy: NcclCommunicator(int ndev, tuple commId, int rank), asserting len(commId) == 128
        assert type(size) is int and type(rank) is int
        if type(uid) is not tuple or len(uid) != 128:
            raise TypeError(f"commId must be a tuple of 128 chars, got {type(uid).__name__}")
        with self.cond:
            if rank in self.never_init:
                self.cond.wait_for(lambda: self.released, 30)
            self.inits.setdefault(uid, []).append(rank)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(self.inits[uid]) >= size or self.released, 30):
                raise FakeNcclError("ncclCommInitRank: not every rank joined")
            comm = FakeComm(self, uid, rank, size)
            self.comms.append(comm)
            return comm

    def release(self) -> None:
        with self.cond:
            self.released = True
            self.cond.notify_all()

    def issue(self, comm: FakeComm, kind: str, stream: int, args: tuple) -> None:
        op = FakeOp(kind, args)
        self.streams[stream].ops.append(op)
        with self.cond:
            key = (comm.uid, comm.seq)
            comm.seq += 1
            slot = self.pending.setdefault(key, {})
            slot[comm.rank] = op
            if len(slot) == comm.size:
                self._complete(key, slot)

    def _complete(self, key: tuple, slot: dict[int, FakeOp]) -> None:
        del self.pending[key]
        ops = [slot[r] for r in range(len(slot))]
        shape = {(op.kind,) + op.args[2:] for op in ops}  # everything but the two pointers
        comms = [c for c in self.comms if c.uid == key[0]]
        if len(shape) != 1 or self.fail_next:
            self.fail_next = False
            for c in comms:
                c.error = FakeNcclError("ncclInvalidUsage: ranks issued different collectives")
            return
        kind, size = ops[0].kind, len(ops)
        if kind == "allReduce":
            count, code, op_code = ops[0].args[2:5]
            data = [_memory(op.args[0], count, code).copy() for op in ops]
            total = data[0]
            for d in data[1:]:
                total = UFUNCS[op_code](total, d)
            for op in ops:
                _memory(op.args[1], count, code)[:] = total
        elif kind == "reduceScatter":
            count, code, op_code = ops[0].args[2:5]
            data = [_memory(op.args[0], count * size, code).copy() for op in ops]
            total = data[0]
            for d in data[1:]:
                total = UFUNCS[op_code](total, d)
            for r, op in enumerate(ops):
                _memory(op.args[1], count, code)[:] = total[r * count:(r + 1) * count]
        elif kind == "allGather":
            count, code = ops[0].args[2:4]
            data = np.concatenate([_memory(op.args[0], count, code).copy() for op in ops])
            for op in ops:
                _memory(op.args[1], count * size, code)[:] = data
        elif kind == "broadcast":
            count, code, root = ops[0].args[2:5]
            data = _memory(ops[root].args[0], count, code).copy()
            for op in ops:
                _memory(op.args[1], count, code)[:] = data
        for op in ops:
            op.done = True


class FakeComm:
    """cupy's ``NcclCommunicator`` methods, same arguments, over numpy memory."""

    def __init__(self, world: FakeNcclWorld, uid: tuple, rank: int, size: int):
        self.world, self.uid, self.rank, self.size = world, uid, rank, size
        self.seq = 0
        self.error: Exception | None = None
        self.aborted = False
        self.destroyed = False

    def _issue(self, kind: str, stream: int, *args: Any) -> None:
        if self.aborted or self.destroyed:
            raise FakeNcclError("communicator used after abort/destroy")
        assert all(type(a) is int for a in args), args
        self.world.calls.append((self.rank, kind, *args[2:]))
        self.world.issue(self, kind, stream, args)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._issue("allReduce", stream, sendbuf, recvbuf, count, datatype, op)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._issue("reduceScatter", stream, sendbuf, recvbuf, recvcount, datatype, op)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._issue("allGather", stream, sendbuf, recvbuf, count, datatype)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._issue("broadcast", stream, sendbuff, recvbuff, count, datatype, root)

    def check_async_error(self) -> None:
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """As ncclCommAbort: this rank's kernels still in flight exit (its stream moves on), unfinished."""
        self.aborted = True
        with self.world.cond:
            for (uid, _), slot in self.world.pending.items():
                if uid == self.uid and self.rank in slot:
                    slot[self.rank].done = True

    def destroy(self) -> None:
        self.destroyed = True


class GpuArray(np.ndarray):
    """A numpy array that the fake device treats as a GPU array (plain numpy arrays are 'host' arrays)."""


def gpu(x: Any) -> GpuArray:
    return np.ascontiguousarray(x).view(GpuArray)


class FakeDevice:
    """``CupyDevice``'s interface over numpy; ``inputs_ready`` stands for the caller's stream."""

    xp = np

    def __init__(self, world: FakeNcclWorld):
        self.world = world
        self.nccl = world.module
        self.inputs_ready = lambda: True

    @staticmethod
    def accepts(array: Any) -> bool:
        return isinstance(array, GpuArray)

    def device_of(self, array: Any) -> int:
        return 0

    def using(self, device: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_stream(self) -> FakeStream:
        stream = FakeStream()
        self.world.streams[id(stream)] = stream
        return stream

    def record(self, stream: FakeStream | None = None) -> FakeEvent:
        if stream is None:
            return FakeEvent(self.inputs_ready)
        ops = list(stream.ops)
        return FakeEvent(lambda: all(op.done for op in ops))

    @staticmethod
    def done(event: FakeEvent) -> bool:
        return bool(event.ready())

    @staticmethod
    def pointer(array: np.ndarray) -> int:
        assert array.flags.c_contiguous
        return int(array.ctypes.data)

    @staticmethod
    def stream_pointer(stream: FakeStream) -> int:
        return id(stream)

    @staticmethod
    def to_host(array: Any) -> np.ndarray:
        return np.asarray(array)


class FakeScheduler:
    """The scheduler plugin's keyed exchange, in memory; values go through JSON as msgpack would (tuples -> lists)."""

    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.meetings: dict[str, dict[int, Any]] = {}
        self.keys: list[str] = []

    def exchange_for(self, rank: int, mailbox):
        def exchange(key: str, value: Any, deadline: float, run_id: int) -> dict[int, Any]:
            value = json.loads(json.dumps(value))
            with self.cond:
                if key not in self.meetings:
                    self.keys.append(key)
                self.meetings.setdefault(key, {})[rank] = value
                self.cond.notify_all()
                while len(self.meetings[key]) < self.size:
                    mailbox.check(run_id)
                    if time.monotonic() >= deadline:
                        raise MailboxTimeout(key)
                    self.cond.wait(0.01)
                return dict(self.meetings[key])

        return exchange


def nccl_group(size: int = 2, algorithm: Algorithm | None = None):
    """An in-memory group of ``size`` communicators, each with an NCCL engine over the fake."""
    group = InMemoryGroup(size, algorithm)
    world = FakeNcclWorld(size)
    scheduler = FakeScheduler(size)
    for comm in group.comms:
        mailbox = comm.transport.mailbox
        comm.nccl = NcclEngine(comm.rank, size, mailbox, scheduler.exchange_for(comm.rank, mailbox),
                               FakeDevice(world))
    return group, world, scheduler


def nccl_calls(world: FakeNcclWorld, kind: str | None = None) -> list[tuple]:
    return [c for c in world.calls if kind is None or c[1] == kind]


@pytest.fixture(autouse=True)
def _release_fake_inits():
    yield
    while WORLDS:
        WORLDS.pop().release()  # no blocked fake NcclCommunicator(...) outlives its test


# -- mapping and selection ---------------------------------------------------------------------


def test_dtype_and_op_constants_are_nccls():
    expected = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int8": "NCCL_INT8",
                "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8", "uint32": "NCCL_UINT32",
                "uint64": "NCCL_UINT64", "bool": "NCCL_UINT8"}
    for name, constant in expected.items():
        assert nccl_dtype_name(np.dtype(name)) == constant
        assert TYPES[CONSTANTS[constant]] == (np.uint8 if name == "bool" else np.dtype(name).type)
    for name in ("int16", "uint16", "complex64", "float128" if hasattr(np, "float128") else "complex128"):
        assert nccl_dtype_name(np.dtype(name)) is None  # NCCL has no such type: generic algorithms
    import ml_dtypes

    assert nccl_dtype_name(np.dtype(ml_dtypes.bfloat16)) is None
    assert nccl_dtype_name(np.dtype(ml_dtypes.bfloat16), bfloat16=True) == "NCCL_BFLOAT16"

    f32 = np.dtype("float32")
    assert [nccl_op_name(op, f32) for op in ReduceOp] == ["NCCL_SUM", "NCCL_SUM", "NCCL_MAX", "NCCL_MIN", "NCCL_PROD"]
    b = np.dtype(bool)
    assert nccl_op_name(ReduceOp.SUM, b) == "NCCL_MAX"  # or
    assert nccl_op_name(ReduceOp.PRODUCT, b) == "NCCL_MIN"  # and
    with pytest.raises(TypeError):
        nccl_op_name(ReduceOp.MEAN, b)


def test_parse_setting():
    assert parse_setting("auto") and parse_setting(True) and parse_setting("AUTO")
    assert not parse_setting(False) and not parse_setting("false") and not parse_setting(None)
    with pytest.raises(ValueError, match="nccl"):
        parse_setting("always")


def test_group_features_decide_for_the_whole_group():
    ok = {"version": 21903, "bfloat16": True}
    usable, bf16, _ = group_features({0: {**ok, "gpu": "h/0"}, 1: {**ok, "gpu": "h/1"}}, 2)
    assert usable and bf16
    usable, _, reason = group_features({0: {**ok, "gpu": "h/0"}, 1: None}, 2)
    assert not usable and "[1]" in reason
    usable, _, reason = group_features({0: {**ok, "gpu": "h/0"}, 1: {**ok, "gpu": "h/0"}}, 2)
    assert not usable and "share the GPU" in reason
    usable, _, reason = group_features({0: {**ok, "gpu": "a/0"}, 1: {**ok, "version": 2308, "gpu": "b/0"}}, 2)
    assert not usable and "2.4" in reason
    old = {"version": 2908, "bfloat16": True}
    usable, bf16, _ = group_features({0: {**old, "gpu": "a/0"}, 1: {**old, "gpu": "b/0"}}, 2)
    assert usable and not bf16  # NCCL 2.9 has no bfloat16
    # NCCL refuses ranks of different versions (ncclInvalidUsage at init): never try
    usable, _, reason = group_features({0: {**ok, "gpu": "a/0"}, 1: {**ok, "version": 21904, "gpu": "b/0"}}, 2)
    assert not usable and "different NCCL versions" in reason
    # CPU groups (no replica reports NCCL) get no engine, without importing cupy
    assert engine_for_group(0, 2, {0: None, 1: None}, None, None) is None
    assert nccl_support.local_features(enabled=True, on_gpu=False) is None
    assert nccl_support.local_features(enabled=False, on_gpu=True) is None


def test_cupy_device_accepts_only_gpu_arrays():
    fake_cupy = type("ndarray", (), {"__module__": "cupy._core.core"})
    assert CupyDevice.accepts(fake_cupy())
    assert not CupyDevice.accepts(np.ones(3))
    assert not CupyDevice.accepts(gpu(np.ones(3)))  # the test marker is numpy underneath


@pytest.mark.parametrize(
    "options, algorithm, leaves, uses_nccl",
    [
        (None, "auto", "gpu", True),
        (CommunicationOptions(implementation="NCCL"), "auto", "gpu", True),
        (CommunicationOptions(implementation="RING"), "auto", "gpu", False),  # RING forces the generic ring
        (None, "ring", "gpu", True),  # NcclAllReduce(num_packs) maps onto the ring algorithm
        (None, "hierarchical", "gpu", False),
        (None, "reduce_to_one", "gpu", False),
        (CommunicationOptions(implementation="NCCL"), "auto", "host", False),  # NCCL on CPU arrays: the ring
        (None, "auto", "mixed", False),
    ],
)
def test_which_all_reduces_take_nccl(options, algorithm, leaves, uses_nccl):
    group, world, _ = nccl_group(2, Algorithm(algorithm))
    xs = [np.arange(6, dtype=np.float32) + r for r in range(2)]

    def value(r):
        if leaves == "gpu":
            return {"a": gpu(xs[r]), "b": gpu(xs[r] * 2)}
        if leaves == "host":
            return {"a": xs[r], "b": xs[r] * 2}
        return {"a": gpu(xs[r]), "b": xs[r] * 2}

    results = group.run_ranks(lambda c: c.all_reduce("SUM", value(c.rank), options))
    for r in results:
        assert not isinstance(r, Exception), r
        np.testing.assert_array_equal(r["a"], xs[0] + xs[1])
        np.testing.assert_array_equal(r["b"], 2 * (xs[0] + xs[1]))
    assert bool(nccl_calls(world, "allReduce")) == uses_nccl
    assert bool(world.comms) == uses_nccl  # no communicator is made for collectives that do not use it


# -- results against numpy ---------------------------------------------------------------------

DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint32", "uint64", "int16"]


def _expected(op: ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    if op is ReduceOp.MEAN:
        total = np.sum(xs, axis=0, dtype=xs[0].dtype)
        if total.dtype.kind in "iu":
            return np.trunc(total / len(xs)).astype(total.dtype)
        return total / total.dtype.type(len(xs))
    return NUMPY_OPS[op](np.stack(xs))


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_every_op_and_dtype_matches_numpy(op, dtype):
    size = 3
    group, world, _ = nccl_group(size)
    xs = random_inputs(size, (13,), dtype, seed=1)
    if dtype == "bool" and op is ReduceOp.MEAN:  # an error everywhere, raised on every rank before NCCL runs
        results = group.run_ranks(lambda c: c.all_reduce(op, gpu(xs[c.rank])))
        assert all(isinstance(r, TypeError) and "MEAN is not defined for bool" in str(r) for r in results), results
        assert nccl_calls(world) == []
        return
    results = group.run_ranks(lambda c: c.all_reduce(op, gpu(xs[c.rank])))
    expected = _expected(op, xs) if dtype != "bool" else {
        ReduceOp.SUM: np.logical_or.reduce(xs), ReduceOp.PRODUCT: np.logical_and.reduce(xs),
        ReduceOp.MAX: np.max(xs, axis=0), ReduceOp.MIN: np.min(xs, axis=0)}[op]
    for r in results:
        assert not isinstance(r, Exception), r
        assert r.dtype == np.dtype(dtype) and r.shape == (13,)
        np.testing.assert_allclose(r.astype("float64"), expected.astype("float64"), rtol=2e-3)
        assert np.array_equal(r, results[0])
    calls = nccl_calls(world, "allReduce")
    if dtype == "int16":
        assert calls == []  # no NCCL type: the generic ring carried it
    else:
        code = CONSTANTS[nccl_dtype_name(np.dtype(dtype))]
        assert {c[2:] for c in calls} == {(13, code, CONSTANTS[nccl_op_name(op, np.dtype(dtype))])}
        assert len(calls) == size


def test_packs_are_reduced_in_place_and_the_callers_array_is_never_written():
    group, world, _ = nccl_group(2, Algorithm("ring", num_packs=2))
    mine = [np.arange(4, dtype=np.float32) * (r + 1) for r in range(2)]
    copies = [m.copy() for m in mine]

    # one contiguous leaf: a borrowed pack, reduced out of place
    results = group.run_ranks(lambda c: c.all_reduce("SUM", gpu(mine[c.rank])))
    for r in results:
        np.testing.assert_array_equal(r, mine[0] + mine[1])
    for m, c in zip(mine, copies):
        np.testing.assert_array_equal(m, c)
    assert len(nccl_calls(world, "allReduce")) == 2

    # four leaves of two dtypes: num_packs=2 packs per dtype, each one allReduce
    def structure(r):
        return [gpu(mine[r]), gpu(mine[r] + 1), gpu(np.full(3, r + 1, np.int64)), gpu(np.full(5, r, np.int64))]

    before = len(nccl_calls(world, "allReduce"))
    results = group.run_ranks(lambda c: c.all_reduce("MEAN", structure(c.rank)))
    for r in results:
        np.testing.assert_allclose(r[0], (mine[0] + mine[1]) / 2)
        np.testing.assert_allclose(r[1], (mine[0] + mine[1]) / 2 + 1)
        assert r[2].tolist() == [1, 1, 1] and r[3].tolist() == [0] * 5  # (1 + 2) // 2, (0 + 1) // 2: truncated
    assert len(nccl_calls(world, "allReduce")) - before == 2 * 4
    assert len(world.ids) == 1  # one communicator per group, made once


def test_broadcast_all_gather_and_reduce_scatter_match_numpy():
    size = 3
    group, world, _ = nccl_group(size)
    rng = np.random.default_rng(3)
    data = [{"w": rng.standard_normal((2, 3)).astype(np.float32), "flags": rng.random(4) > 0.5} for _ in range(size)]

    out = group.run_ranks(lambda c: c.broadcast({k: gpu(v) for k, v in data[c.rank].items()}, root=1))
    for r in out:
        np.testing.assert_array_equal(r["w"], data[1]["w"])
        np.testing.assert_array_equal(r["flags"], data[1]["flags"])
    assert {c[1] for c in world.calls} == {"broadcast"}

    # uneven lengths along the gathered axis, any dtype (bytes)
    parts = [rng.integers(0, 9, (2, r + 1)).astype(np.int16) for r in range(size)]
    out = group.run_ranks(lambda c: c.all_gather([gpu(parts[c.rank]), gpu(parts[c.rank][0] > 3)], axis=-1))
    for r in out:
        assert not isinstance(r, Exception), r
        np.testing.assert_array_equal(r[0], np.concatenate(parts, axis=1))
        np.testing.assert_array_equal(r[1], np.concatenate([p[0] > 3 for p in parts]))
    assert nccl_calls(world, "allGather")

    for rows in (6, 7):  # even parts take reduceScatter, uneven ones an allReduce of the whole
        xs = [rng.standard_normal((rows, 2)).astype(np.float64) for _ in range(size)]
        before = {k: len(nccl_calls(world, k)) for k in ("reduceScatter", "allReduce")}
        out = group.run_ranks(lambda c, xs=xs: c.reduce_scatter("MEAN", gpu(xs[c.rank]), axis=0))
        split = np.array_split(np.mean(xs, axis=0), size)
        for rank, r in enumerate(out):
            assert not isinstance(r, Exception), r
            np.testing.assert_allclose(r, split[rank])
        used = "reduceScatter" if rows % size == 0 else "allReduce"
        assert len(nccl_calls(world, used)) - before[used] == size

    # a dtype NCCL cannot reduce goes through the generic reduce-scatter
    before = len(world.calls)
    xs = [np.arange(6, dtype=np.int16) + r for r in range(size)]
    out = group.run_ranks(lambda c: c.reduce_scatter("SUM", gpu(xs[c.rank])))
    for rank, r in enumerate(out):
        np.testing.assert_array_equal(r, np.array_split(sum(xs), size)[rank])
    assert len(world.calls) == before


# -- mismatches, timeouts, aborts ----------------------------------------------------------------


def test_a_mismatch_raises_on_every_replica_before_nccl_moves_data():
    group, world, _ = nccl_group(2)
    out = group.run_ranks(lambda c: c.all_reduce("SUM", gpu(np.ones(3 + c.rank, np.float32)),
                                                   CommunicationOptions(timeout_seconds=10)))
    assert all(isinstance(r, CollectiveMismatchError) for r in out), out
    assert world.calls == [] and world.ids == []  # no communicator made, no data moved

    # one replica on the NCCL path, the other forcing the ring: the signatures differ
    out = group.run_ranks(lambda c: c.all_reduce(
        "SUM", gpu(np.ones(3, np.float32)), CommunicationOptions(implementation="RING" if c.rank else "AUTO",
                                                                 timeout_seconds=10)), run_id=2)
    assert all(isinstance(r, CollectiveMismatchError) for r in out), out
    assert "nccl" in str(out[0])
    assert world.calls == []


def test_a_replica_stuck_before_nccl_times_out_aborts_communicators_and_a_later_run_remakes_them():
    group, world, scheduler = nccl_group(2)
    x = [gpu(np.full(4, r + 1.0)) for r in range(2)]
    assert group.run_ranks(lambda c: c.all_reduce("SUM", x[c.rank]))[0].tolist() == [3.0] * 4
    first = sorted(world.comms, key=lambda c: c.rank)

    group.comms[1].nccl.device.inputs_ready = lambda: False  # replica 1's inputs never become ready
    start = time.monotonic()
    out = group.run_ranks(lambda c: c.all_reduce("SUM", x[c.rank], CommunicationOptions(timeout_seconds=0.5)),
                          run_id=2)
    assert time.monotonic() - start < 5
    assert isinstance(out[0], CollectiveTimeoutError), out  # replica 0 waited inside NCCL
    assert isinstance(out[1], CollectiveError), out  # replica 1 got the abort while waiting for its inputs
    assert first[0].aborted and not first[1].aborted  # the one in flight was aborted at once

    # the client counts the failed run; every replica meets under a new key
    group.comms[1].nccl.device.inputs_ready = lambda: True

    def again(c):
        c.begin_attempt(1)  # the fake group starts attempt 1 itself, as the client would
        return c.all_reduce("SUM", x[c.rank])

    out = group.run_ranks(again, run_id=3)
    assert [r.tolist() for r in out] == [[3.0] * 4] * 2
    assert first[1].aborted
    # replica 0 dropped its communicator: the ranks learn it at the keep exchange and all make a new one
    assert scheduler.keys == ["nccl/0", "nccl-keep/1", "nccl/1"] and len(world.ids) == 2
    assert len(world.comms) == 4 and world.comms[2].uid == world.comms[3].uid != first[0].uid
    assert [c.nccl.communicators_made for c in group.comms] == [2, 2]


def test_a_failed_command_that_never_reached_nccl_keeps_the_communicator():
    group, world, scheduler = nccl_group(2)
    x = [gpu(np.full(4, r + 1.0)) for r in range(2)]
    assert group.run_ranks(lambda c: c.all_reduce("SUM", x[c.rank]))[0].tolist() == [3.0] * 4

    def after_a_failure(c):
        c.begin_attempt(1)  # a command failed outside NCCL (a user error): the client counts it
        return c.all_reduce("SUM", x[c.rank])

    out = group.run_ranks(after_a_failure, run_id=2)
    assert [r.tolist() for r in out] == [[3.0] * 4] * 2
    assert scheduler.keys == ["nccl/0", "nccl-keep/1"]  # one exchange, no new unique id
    assert len(world.comms) == 2 and not any(c.aborted for c in world.comms)
    assert [c.nccl.communicators_made for c in group.comms] == [1, 1]
    out = group.run_ranks(lambda c: c.all_reduce("SUM", x[c.rank]), run_id=3)  # the same attempt: no exchange
    assert scheduler.keys == ["nccl/0", "nccl-keep/1"]


def test_an_abort_while_inside_nccl_raises_at_once_and_aborts_the_communicator():
    group, world, _ = nccl_group(2)
    x = [gpu(np.ones(8, np.float32)) for _ in range(2)]
    group.run_ranks(lambda c: c.all_reduce("SUM", x[c.rank]))
    group.comms[1].nccl.device.inputs_ready = lambda: False

    def lose_replica_1():
        time.sleep(0.3)
        for comm in group.comms:
            comm.transport.mailbox.abort_group(Abort("lost", "replica 1 was lost: its worker left", None))

    threading.Thread(target=lose_replica_1).start()
    start = time.monotonic()
    out = group.run_ranks(lambda c: c.all_reduce("SUM", x[c.rank], CommunicationOptions(timeout_seconds=60)),
                          run_id=2)
    assert time.monotonic() - start < 5  # the abort, not the 60 s deadline
    assert all(isinstance(r, ReplicaLostError) for r in out), out
    assert [c.aborted for c in world.comms if c.rank == 0] == [True]  # it was inside NCCL


def test_an_asynchronous_nccl_error_raises_and_aborts():
    group, world, _ = nccl_group(2)
    world.fail_next = True
    start = time.monotonic()
    out = group.run_ranks(lambda c: c.all_reduce("SUM", gpu(np.ones(8, np.float32)),
                                                 CommunicationOptions(timeout_seconds=60)))
    assert time.monotonic() - start < 10
    assert all(isinstance(r, CollectiveAbortedError) for r in out), out
    assert any("NCCL reported an error" in str(r) and "FakeNcclError" in str(r) for r in out)
    assert any(c.aborted for c in world.comms)


def test_a_communicator_that_never_forms_times_out_instead_of_hanging():
    group, world, _ = nccl_group(2)
    world.never_init = {1}  # replica 1's NcclCommunicator(...) blocks, so replica 0's blocks too
    start = time.monotonic()
    out = group.run_ranks(lambda c: c.all_reduce("SUM", gpu(np.ones(8, np.float32)),
                                                 CommunicationOptions(timeout_seconds=0.5)))
    assert time.monotonic() - start < 5
    assert all(isinstance(r, CollectiveTimeoutError) for r in out), out
    assert [c.nccl._comm for c in group.comms] == [None, None]
    world.release()  # the blocked inits finish late: the engine aborts what they made
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (world.comms and all(c.aborted for c in world.comms)):
        time.sleep(0.01)
    assert world.comms and all(c.aborted for c in world.comms)


def test_a_failed_init_raises_a_collective_error_naming_the_nccl_result():
    group, world, _ = nccl_group(2)

    def refuse(size, uid, rank):  # cupy's NcclError(6) itself fails: its table only names 0-5
        raise KeyError(6)

    world.module.NcclCommunicator = refuse
    out = group.run_ranks(lambda c: c.all_reduce("SUM", gpu(np.ones(8, np.float32)),
                                                 CommunicationOptions(timeout_seconds=10)))
    assert all(isinstance(r, CollectiveAbortedError) for r in out), out
    assert any("could not make its NCCL communicator" in str(r) and "ncclRemoteError" in str(r) for r in out)


def test_describe_nccl_error():
    class NcclError(Exception):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    assert nccl_support.describe_nccl_error(NcclError(5)).startswith("ncclInvalidUsage")
    assert nccl_support.describe_nccl_error(KeyError(6)).startswith("ncclRemoteError")
    assert nccl_support.describe_nccl_error(ValueError("x")) == "ValueError: x"


def test_event_status_errors_raise_instead_of_waiting_for_the_deadline():
    class CUDARuntimeError(RuntimeError):
        pass

    def check_status(status):
        if status != 0:
            raise CUDARuntimeError(f"cudaError {status}")

    statuses = iter([600, 0, 700])  # not ready, done, an illegal address behind the event
    runtime = types.SimpleNamespace(eventQuery=lambda ptr: next(statuses), check_status=check_status)
    device = object.__new__(CupyDevice)
    device.xp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    event = types.SimpleNamespace(ptr=1)
    assert device.done(event) is False
    assert device.done(event) is True
    with pytest.raises(CUDARuntimeError, match="700"):
        device.done(event)


def test_close_aborts_the_communicator():
    group, world, _ = nccl_group(2)
    group.run_ranks(lambda c: c.all_reduce("SUM", gpu(np.ones(2, np.float32))))
    for comm in group.comms:
        comm.close()
    assert [c.aborted for c in world.comms] == [True, True]
    assert all(comm.nccl._comm is None for comm in group.comms)


# -- the scheduler's keyed exchange ----------------------------------------------------------------


def test_scheduler_exchange_meets_every_rank_and_wakes_on_failure():
    async def main():
        plugin = DaskdistSchedulerPlugin()
        plugin.scheduler = types.SimpleNamespace(log_event=lambda *a, **k: None, stream_comms={})
        plugin.groups["g"] = GroupState("g", ["w0", "w1"], None, status="running")
        alone = await plugin.exchange("g", "nccl/0", 0, [1, 2, 3], timeout=0.05)
        assert alone == {"status": "waiting"}
        both = await asyncio.gather(plugin.exchange("g", "nccl/0", 0, [1, 2, 3], timeout=1),
                                    plugin.exchange("g", "nccl/0", 1, None, timeout=1))
        assert [b["values"] for b in both] == [{"0": [1, 2, 3], "1": None}] * 2
        assert "nccl/0" not in plugin.groups["g"].meetings  # forgotten once everyone has it

        waiting = asyncio.ensure_future(plugin.exchange("g", "nccl/1", 0, [4], timeout=30))
        await asyncio.sleep(0.05)
        plugin.groups["g"].reason = "replica 1 of g was lost"
        plugin._fail(plugin.groups["g"], lost_worker="w1")
        answer = await asyncio.wait_for(waiting, 1)
        assert answer["status"] == "error" and "lost" in answer["message"]

    asyncio.run(main())


def test_the_client_counts_failed_runs_and_cpu_groups_have_no_engine(threaded_client):
    with dd.MirroredStrategy(client=threaded_client) as strategy:
        group = strategy.extended.group
        assert group.spec.nccl == "auto"

        def engine():
            from daskdist import context

            return context.current_runtime().communicator.nccl

        assert strategy.run(engine) is None  # None on every replica; TF's regroup returns that None itself
        with pytest.raises(ZeroDivisionError):
            strategy.run(lambda: 1 / 0)
        assert group.failed_runs == 1
        strategy.run(lambda: 1)
        assert group.failed_runs == 1
    with dask.config.set({"daskdist.collective.nccl": "sometimes"}), pytest.raises(ValueError, match="nccl"):
        dd.MirroredStrategy(client=threaded_client)


# -- real GPUs ----------------------------------------------------------------------------------------


def _gpus() -> int:
    try:
        from cupy.cuda import nccl
    except Exception:
        return 0
    return local_gpu_count() if getattr(nccl, "available", False) else 0


#: NCCL needs one GPU per rank: two replicas, two GPUs
needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs cupy with NCCL and 2 CUDA GPUs")


def _gpu_cluster():
    """Two worker processes, one GPU each (CUDA_VISIBLE_DEVICES per nanny; dask-cuda is not needed)."""
    import cloudpickle
    from distributed import Nanny, Scheduler, SpecCluster

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replica functions use this module's helpers
    workers = {f"gpu-{i}": {"cls": Nanny, "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": str(i)}}}
               for i in range(2)}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR)


@pytest.fixture(scope="module")
def gpu_client():
    from distributed import Client

    with _gpu_cluster() as cluster, Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        yield client


def _engine_made():
    from daskdist import context

    engine = context.current_runtime().communicator.nccl
    return -1 if engine is None else engine.communicators_made


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_every_op_and_dtype_against_numpy(gpu_client):
    import cupy

    dtypes = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool"]
    with dd.MirroredStrategy(client=gpu_client) as strategy:
        assert all("GPU" in d for d in strategy.extended.worker_devices)

        def fn():
            ctx = dd.get_replica_context()
            out = {}
            for dtype in dtypes:
                x = cupy.asarray(random_inputs(2, (1000,), dtype, seed=7)[ctx.replica_id_in_sync_group])
                for op in ReduceOp:
                    if dtype == "bool" and op is ReduceOp.MEAN:
                        continue
                    result = ctx.all_reduce(op, x)
                    assert type(result).__module__.startswith("cupy")
                    out[dtype, op.name] = cupy.asnumpy(result)
            return out, _engine_made()

        results = strategy.experimental_local_results(strategy.run(fn))
        for out, made in results:
            assert made == 1
            for (dtype, op_name), value in out.items():
                xs = random_inputs(2, (1000,), dtype, seed=7)
                op = ReduceOp[op_name]
                if dtype == "bool":
                    expected = {"SUM": np.logical_or(*xs), "PRODUCT": np.logical_and(*xs),
                                "MAX": np.maximum(*xs), "MIN": np.minimum(*xs)}[op_name]
                else:
                    expected = _expected(op, xs)
                np.testing.assert_allclose(value.astype("float64"), expected.astype("float64"), rtol=2e-3,
                                           err_msg=f"{dtype} {op_name}")
        np.testing.assert_array_equal(results[0][0]["float32", "SUM"], results[1][0]["float32", "SUM"])


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_broadcast_all_gather_reduce_scatter(gpu_client):
    import cupy

    with dd.MirroredStrategy(client=gpu_client) as strategy:

        def fn():
            ctx = dd.get_replica_context()
            r = ctx.replica_id_in_sync_group
            x = cupy.arange(6, dtype=cupy.float32).reshape(2, 3) + 10 * r
            return (cupy.asnumpy(ctx.broadcast(x, root=1)),
                    cupy.asnumpy(ctx.all_gather(cupy.ones((r + 1, 2), cupy.int16) * r, axis=0)),
                    cupy.asnumpy(ctx.reduce_scatter("SUM", cupy.arange(8, dtype=cupy.float64).reshape(4, 2))))

        out = strategy.experimental_local_results(strategy.run(fn))
        for rank, (b, g, s) in enumerate(out):
            np.testing.assert_array_equal(b, np.arange(6, dtype=np.float32).reshape(2, 3) + 10)
            np.testing.assert_array_equal(g, np.array([[0, 0], [1, 1], [1, 1]], np.int16))
            np.testing.assert_array_equal(s, (2 * np.arange(8.0).reshape(4, 2))[2 * rank:2 * rank + 2])


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_mismatch_raises_on_every_replica(gpu_client):
    import cupy

    with dd.MirroredStrategy(client=gpu_client) as strategy:

        def fn():
            r = dd.get_replica_context().replica_id_in_sync_group
            try:
                dd.get_replica_context().all_reduce("SUM", cupy.ones(3 + r, cupy.float32),
                                                    dd.CommunicationOptions(timeout_seconds=30))
            except dd.CollectiveError as e:
                return type(e).__name__
            return "no error"

        start = time.monotonic()
        kinds = set(strategy.experimental_local_results(strategy.run(fn)))
        assert time.monotonic() - start < 10
        assert kinds <= {"CollectiveMismatchError", "CollectiveAbortedError"} and "CollectiveMismatchError" in kinds


_SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
'''


def _busy_gpu(seconds: float) -> None:
    """Queue a kernel that keeps this replica's stream busy for about ``seconds`` (its NCCL call waits behind it)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    rate_khz = props.get("clockRate") or 2_000_000
    cupy.RawKernel(_SPIN, "spin")((1,), (1,), (cupy.int64(int(seconds * rate_khz * 1000)),))


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_a_timed_out_peer_aborts_everyone_and_the_next_run_remakes_the_communicator(gpu_client):
    import cupy

    with dd.MirroredStrategy(client=gpu_client) as strategy:
        strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", cupy.ones(4)))  # the communicator exists

        def fn():
            ctx = dd.get_replica_context()
            if ctx.replica_id_in_sync_group == 1:
                _busy_gpu(4)  # replica 1 joins the collective but its inputs are late
            return ctx.all_reduce("SUM", cupy.ones(1 << 20, cupy.float32), dd.CommunicationOptions(timeout_seconds=1))

        start = time.monotonic()
        with pytest.raises(dd.CollectiveTimeoutError):
            strategy.run(fn)
        assert time.monotonic() - start < 10
        time.sleep(4)
        out = strategy.run(lambda: (float(dd.get_replica_context().all_reduce("SUM", cupy.ones(4))[0]), _engine_made()))
        assert strategy.experimental_local_results(out) == ((2.0, 2), (2.0, 2))


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.slow
def test_gpu_a_killed_peer_fails_the_other_within_seconds(tmp_path):
    import os
    import signal

    import cupy
    from distributed import Client

    log = tmp_path / "lost"
    with _gpu_cluster() as cluster, Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        strategy = dd.MirroredStrategy(client=client)
        strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", cupy.ones(4)))
        victim = strategy.extended.worker_addresses[1]
        pid = worker_pid(client, victim)

        def fn():
            ctx = dd.get_replica_context()
            if ctx.replica_id_in_sync_group == 1:
                _busy_gpu(60)  # replica 1 enters the collective; its NCCL call waits behind this kernel
            start = time.monotonic()
            try:
                return ctx.all_reduce("SUM", cupy.ones(1 << 20, cupy.float32),
                                      dd.CommunicationOptions(timeout_seconds=120))
            except dd.ReplicaLostError:
                log.write_text(f"{time.monotonic() - start:.2f}")
                raise

        run = RunInBackground(strategy, fn)
        time.sleep(3)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        error = run.join(30)
        assert isinstance(error, dd.ReplicaLostError), repr(error)
        assert run.at - killed_at < 10
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not log.exists():
            time.sleep(0.1)
        assert log.exists() and float(log.read_text()) < 15  # replica 0 raised ReplicaLostError from inside NCCL
        strategy.close()
