"""The all-reduce engines: which one takes a pack, the lane's transport API, and collective/'s layering.

Pure decisions are checked directly; the lane API runs over two real
shared-memory transports in this process.
"""

from __future__ import annotations

import ast
import os
import pathlib
import threading
import time

import numpy as np
import pytest

import daskdist
from daskdist.collective.core.buffers import BufferPool
from daskdist.collective.core.communicator import Algorithm
from daskdist.collective.core.engines.base import PackPlan
from daskdist.collective.core.engines.direct import DirectEngine, EmptyEngine
from daskdist.collective.core.engines.hierarchical import HierarchicalEngine
from daskdist.collective.core.engines.packed import PackedAllReduce, pack_engines
from daskdist.collective.core.engines.reduce_to_one import ReduceToOneEngine
from daskdist.collective.core.engines.ring import RingEngine
from daskdist.collective.core.engines.single_copy.all_reduce import SingleCopyAllReduce
from daskdist.collective.core.engines.single_copy.engine import SingleCopyEngine
from daskdist.collective.mailbox import Mailbox, MailboxTimeout
from daskdist.collective.transport.framing import ARRAY, MAX_NDIM, dtype_text
from daskdist.collective.transport.shm import ShmTransport, lane_header
from daskdist.collective.transport.shm_lane import LaneMismatch
from daskdist.ops import ReduceOp

from .fakes import InMemoryGroup

SMALL = 64 * 1024
COLLECTIVE = pathlib.Path(daskdist.__file__).parent / "collective"


def _chooser(name: str, multi_host: bool = False, single_copy: bool = False) -> PackedAllReduce:
    algorithm = Algorithm(name)
    single = SingleCopyAllReduce(1 << 20) if single_copy else None
    engines = pack_engines(algorithm, BufferPool(), ["a", "a", "b"], multi_host, SMALL, single)
    return PackedAllReduce(engines, name)


def _pack(nbytes: int, forced_ring: bool = False, borrowed: bool = False) -> PackPlan:
    return PackPlan(np.zeros(nbytes // 4, np.float32), ReduceOp.SUM, borrowed, forced_ring)


@pytest.mark.parametrize(("name", "nbytes", "forced", "multi_host", "single_copy", "engine"), [
    ("auto", 4096, False, False, False, DirectEngine),
    ("auto", SMALL, False, False, False, DirectEngine),  # the limit is inclusive
    ("auto", SMALL + 4, False, False, False, RingEngine),
    ("auto", 4096, True, False, False, RingEngine),  # RING implementation or algorithm: no direct
    ("auto", 4 << 20, False, True, False, HierarchicalEngine),
    ("auto", 4 << 20, True, True, False, RingEngine),
    ("auto", 4 << 20, False, False, True, SingleCopyEngine),  # before probing, every candidate tries it
    ("auto", 4 << 20, True, False, True, RingEngine),
    ("auto", 0, False, False, False, EmptyEngine),
    ("ring", 4096, True, False, False, RingEngine),
    ("direct", 4 << 20, False, False, False, DirectEngine),
    ("hierarchical", 4096, False, False, False, HierarchicalEngine),
    ("hierarchical", 0, False, False, False, EmptyEngine),
    ("reduce_to_one", 0, False, False, False, ReduceToOneEngine),  # it reduces empty packs too
    ("reduce_to_one", 4 << 20, False, False, False, ReduceToOneEngine),
])
def test_each_pack_goes_to_the_first_engine_of_its_algorithm_that_accepts_it(name, nbytes, forced, multi_host,
                                                                             single_copy, engine):
    chooser = _chooser(name, multi_host, single_copy)
    assert type(chooser.choose(_pack(nbytes, forced))) is engine


def test_a_single_copy_candidate_too_small_for_the_agreed_threshold_goes_to_the_ring():
    single = SingleCopyAllReduce(1 << 20)
    single.usable, single.min_bytes = True, 8 << 20  # probed: the peers agreed on 8 MiB
    chooser = PackedAllReduce(pack_engines(Algorithm("auto"), BufferPool(), ["a", "a"], False, SMALL, single), "auto")
    assert type(chooser.choose(_pack(4 << 20))) is RingEngine
    assert type(chooser.choose(_pack(8 << 20))) is SingleCopyEngine
    single.usable = False  # a peer could not read this replica: never again
    assert type(chooser.choose(_pack(64 << 20))) is RingEngine


def test_engines_that_work_in_place_never_write_the_callers_array():
    group = InMemoryGroup(3, Algorithm("hierarchical"), hosts=["a", "a", "b"])
    xs = [np.full(100_000, r + 1.0) for r in range(3)]
    kept = [x.copy() for x in xs]
    results = group.run_ranks(lambda c: c.all_reduce("SUM", xs[c.rank]))
    for r, x, k in zip(results, xs, kept):
        assert not isinstance(r, Exception), r
        assert r.tolist() == [6.0] * 100_000 and np.array_equal(x, k)


def _shm_pair(slot_bytes: int = 1 << 12) -> list[ShmTransport]:
    boxes = [Mailbox(), Mailbox()]
    for box in boxes:
        box.begin_attempt(1)
    name = f"daskdist-e{os.getpid()}{int(time.monotonic() * 1e6) % 10**8}"
    return [ShmTransport(r, ["a", "b"], boxes[r], [1 - r], name, slot_bytes) for r in range(2)]


def _lane_message(rank: int, name: str, value: np.ndarray, sig: bytes) -> tuple[bytes, bytes]:
    field = name.encode().ljust(40, b"\0")
    dims = tuple(value.shape) + (0,) * (MAX_NDIM - value.ndim)
    header = lane_header((rank, field, ARRAY, value.nbytes, 0, value.nbytes, value.ndim, *dims,
                          dtype_text(value.dtype).encode()), sig)
    return header, field


def test_the_lane_writes_one_slot_and_the_peer_reads_it_in_place_then_frees_it():
    t0, t1 = _shm_pair()
    lane0, lane1 = t0.lane(), t1.lane()
    value = np.arange(8, dtype=np.float32)
    key = (value.dtype, value.shape)
    header, field = _lane_message(0, "small#1", value, b"sig")
    try:
        assert lane1.peek[0]((1, 1, 0, field), key) is None  # nothing written yet
        assert lane0.try_write(1, header, 1, 1, value, key)  # written at once
        seen = lane1.peek[0]((1, 1, 0, field), key)
        assert seen is not None and seen.tolist() == value.tolist()
        assert lane1.peek[0]((1, 2, 0, field), key) is None  # another collective's prefix: not this one
        lane1.release[0]()
        assert lane1.peek[0]((1, 1, 0, field), key) is None
    finally:
        for t in (t0, t1):
            t.close()


def test_the_lane_receive_keeps_other_messages_aside_and_names_a_mismatching_peer():
    t0, t1 = _shm_pair()
    lane0, lane1 = t0.lane(), t1.lane()
    value = np.ones(4, np.float64)
    key = (value.dtype, value.shape)
    header, field = _lane_message(0, "small#2", value, b"sig")
    try:
        t0.send(1, (1, 9, 0, "other"), np.full(3, 7.0)).wait(time.monotonic() + 5)  # ahead of the lane message
        assert lane0.try_write(1, header, 1, 1, value, key)
        got, release = lane1.receive(0, 1, 1, "small#2", field, value.nbytes, value.dtype, value.shape,
                                     time.monotonic() + 5)
        assert got.tolist() == [1.0] * 4
        release()
        assert t1.recv(0, (1, 9, 0, "other"), time.monotonic() + 5).tolist() == [7.0] * 3  # it was kept aside
        other_header, _ = _lane_message(0, "small#3", value, b"what replica 0 passed")
        assert lane0.try_write(1, other_header, 1, 2, value, key)
        with pytest.raises(LaneMismatch, match="what replica 0 passed"):
            lane1.receive(0, 1, 2, "small#2", field, value.nbytes, value.dtype, value.shape, time.monotonic() + 5)
        with pytest.raises(MailboxTimeout):
            lane1.receive(0, 1, 3, "small#2", field, value.nbytes, value.dtype, value.shape, time.monotonic() + 0.2)
    finally:
        for t in (t0, t1):
            t.close()


def test_the_lane_writes_nothing_into_a_full_channel_and_queues_instead():
    t0, t1 = _shm_pair()
    lane0, lane1 = t0.lane(), t1.lane()
    value = np.zeros(16, np.int32)
    key = (value.dtype, value.shape)
    header, field = _lane_message(0, "small#4", value, b"s")
    try:
        for seq in range(1, 5):  # four slots
            assert lane0.try_write(1, header, 1, seq, value + seq, key)
        assert not lane0.try_write(1, header, 1, 5, value + 5, key)  # full: nothing written
        handle = lane0.send_queued(1, (1, 5, 0, "small#4"), value + 5, b"s")
        done = threading.Event()

        def drain():
            for seq in range(1, 6):
                got, release = lane1.receive(0, 1, seq, "small#4", field, value.nbytes, value.dtype, value.shape,
                                             time.monotonic() + 5)
                assert got.tolist() == [seq] * 16
                if release is not None:
                    release()
            done.set()

        thread = threading.Thread(target=drain)
        thread.start()
        handle.wait(time.monotonic() + 5)
        thread.join(5)
        assert done.is_set()
    finally:
        for t in (t0, t1):
            t.close()


def _modules() -> list[pathlib.Path]:
    return sorted(COLLECTIVE.rglob("*.py"))


def test_collective_code_reads_configuration_only_through_daskdist_config():
    offenders = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.startswith("dask.config") for a in node.names):
                offenders.append(f"{path.name}: import {node.names[0].name}")
            if isinstance(node, ast.ImportFrom) and (node.module == "dask.config" or (
                    node.module == "dask" and any(a.name == "config" for a in node.names))):
                offenders.append(f"{path.name}: from {node.module} import ...")
            if isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name) \
                    and node.value.id == "dask":
                offenders.append(f"{path.name}:{node.lineno}: dask.config")
    assert offenders == []


def test_nothing_in_collective_imports_the_communicator_or_hides_an_import_cycle():
    offenders = []
    for path in _modules():
        if path.name == "communicator.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            # the process group is the one layer above the communicator: it builds subgroups' communicators
            if isinstance(node, ast.ImportFrom) and node.module == "daskdist.collective.core.communicator" \
                    and path.name != "process_group.py":
                offenders.append(f"{path.relative_to(COLLECTIVE)} imports the communicator")
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and any(
                    isinstance(n, ast.ImportFrom) and (n.module or "").startswith("daskdist") for n in ast.walk(node)):
                offenders.append(f"{path.relative_to(COLLECTIVE)}:{node.lineno} imports daskdist under TYPE_CHECKING")
    assert offenders == []


def test_no_collective_module_is_longer_than_six_hundred_lines():
    lengths = {str(p.relative_to(COLLECTIVE)): len(p.read_text().splitlines()) for p in _modules()}
    assert {name: n for name, n in lengths.items() if n > 600} == {}


class _Float32Device:
    """A device engine (as NCCL's) that takes float32 arrays and reduces them, and answers with marked results."""

    tag = " | fake-device"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def accepts(self, array) -> bool:
        return array.dtype == np.float32

    def reduces(self, dtype) -> bool:
        return dtype == np.float32

    def all_gather(self, call, leaves, axes):
        self.calls.append("all_gather")
        return [np.full(3, 7.0, np.float32) for _ in leaves]

    def reduce_scatter(self, call, leaves, op, axis):
        self.calls.append("reduce_scatter")
        return [np.full(1, 8.0, np.float32) for _ in leaves]

    def broadcast(self, call, leaves, root):
        self.calls.append("broadcast")
        return [np.full(2, 9.0, np.float32) for _ in leaves]


class _RecordingHost:
    """The communicator as the collectives see it: two replicas, runs each body at once and keeps the signature."""

    rank, size = 0, 2

    def __init__(self, device) -> None:
        from daskdist.ops import CommunicationOptions

        self.options = CommunicationOptions()
        self.nccl = device
        self.signatures: list[str] = []

    def run_collective(self, kind, sig, options, body):
        self.signatures.append(sig)
        return body(None)


@pytest.mark.parametrize(("leaves", "implementation", "op", "device_wanted"), [
    ([np.zeros(2, np.float32)], "AUTO", None, True),
    ([np.zeros(2, np.float32), np.zeros(2, np.float64)], "AUTO", None, False),  # one leaf it does not take
    ([np.zeros(2, np.float32)], "RING", None, False),  # the call asks for the ring
    ([np.zeros(2, np.float32)], "AUTO", ReduceOp.SUM, True),
    ([], "AUTO", None, False),
])
def test_the_chooser_gives_a_collective_to_the_device_engine_only_when_it_takes_every_leaf(
        leaves, implementation, op, device_wanted):
    from daskdist.collective.core.engines.choice import moving_engine_for
    from daskdist.collective.core.engines.generic import GENERIC
    from daskdist.ops import CommunicationImplementation, CommunicationOptions

    device = _Float32Device()
    options = CommunicationOptions(implementation=CommunicationImplementation[implementation])
    assert moving_engine_for(device, leaves, options, op) is (device if device_wanted else GENERIC)
    assert moving_engine_for(None, leaves, options, op) is GENERIC


def test_a_reduce_scatter_of_a_dtype_the_device_cannot_reduce_goes_to_the_generic_engine():
    from daskdist.collective.core.engines.choice import moving_engine_for
    from daskdist.collective.core.engines.generic import GENERIC
    from daskdist.ops import CommunicationOptions

    device = _Float32Device()
    device.reduces = lambda dtype: False  # takes the arrays (moves them) but has no reduction for the dtype
    leaves = [np.zeros(2, np.float32)]
    assert moving_engine_for(device, leaves, CommunicationOptions(), ReduceOp.SUM) is GENERIC
    assert moving_engine_for(device, leaves, CommunicationOptions()) is device


def test_all_gather_reduce_scatter_and_broadcast_run_on_the_engine_the_chooser_names_and_sign_it():
    from daskdist.collective.core import collectives

    device = _Float32Device()
    host = _RecordingHost(device)
    value = {"w": np.zeros(4, np.float32)}
    assert collectives.all_gather(host, value, 0)["w"].tolist() == [7.0] * 3
    assert collectives.reduce_scatter(host, "SUM", value)["w"].tolist() == [8.0]
    assert collectives.broadcast(host, value)["w"].tolist() == [9.0] * 2
    assert device.calls == ["all_gather", "reduce_scatter", "broadcast"]
    assert all(sig.endswith(" | fake-device") for sig in host.signatures), host.signatures
