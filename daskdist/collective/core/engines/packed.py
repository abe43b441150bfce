"""The packed all-reduce: each flat pack of a structure goes to the first pack engine that accepts it.

The engines and their order come from the group's algorithm
(``cross_device_ops``), once per communicator (``pack_engines``):

* ``reduce_to_one``: reduce-to-one, for every pack;
* ``direct``, ``ring``, ``hierarchical``: that engine for every non-empty pack;
* ``auto``: direct up to ``small-message-bytes``; then hierarchical when the
  ranks span several hosts and some share one; then single-copy for large
  numpy packs when every peer shares this host; then the ring. A call whose
  implementation is not ``AUTO`` (``RING``, ``NCCL`` on CPU arrays) forces the
  ring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dask.utils import parse_bytes

from daskdist import config
from daskdist.collective.core.buffers import BufferPool
from daskdist.collective.core.call import CollectiveCall
from daskdist.collective.core.engines.base import AllReducePlan, Engine, PackPlan
from daskdist.collective.core.engines.direct import DirectEngine, EmptyEngine
from daskdist.collective.core.engines.hierarchical import HierarchicalEngine
from daskdist.collective.core.engines.pipeline import PieceSize
from daskdist.collective.core.engines.reduce_to_one import ReduceToOneEngine
from daskdist.collective.core.engines.ring import RingEngine
from daskdist.collective.core.engines.single_copy.all_reduce import SingleCopyAllReduce
from daskdist.collective.core.engines.single_copy.engine import SingleCopyEngine

__all__ = ["PackedAllReduce", "pack_engines", "pipeline_pieces"]


def pack_engines(algorithm: Any, buffers: BufferPool, hosts: Sequence[str], multi_host: bool,
                 small_message_bytes: int, single_copy: SingleCopyAllReduce | None,
                 pieces: PieceSize | None = None) -> list[Engine]:
    """The pack engines of a group's ``algorithm`` (an ``Algorithm``), in the order they are asked.

    ``pieces``: the piece size of the pipelined ring and hierarchical
    all-reduce (``None``: ``pipeline_pieces()``, from the config). The ring
    pipelines only when the ranks span several hosts.
    """
    name = algorithm.name
    if pieces is None:
        pieces = pipeline_pieces()
    spans_hosts = len(set(hosts)) > 1
    ring = RingEngine(buffers, pieces if spans_hosts else None)
    if name == "reduce_to_one":
        return [ReduceToOneEngine(algorithm.root, algorithm.accumulation_fn)]
    if name == "direct":
        return [EmptyEngine(), DirectEngine()]
    if name == "hierarchical":
        return [EmptyEngine(), HierarchicalEngine(hosts, False, buffers, pieces)]
    if name == "ring":
        return [EmptyEngine(), ring]
    engines: list[Engine] = [EmptyEngine(), DirectEngine(small_message_bytes)]
    if multi_host:
        engines.append(HierarchicalEngine(hosts, True, buffers, pieces))
    if single_copy is not None:
        engines.append(SingleCopyEngine(single_copy, ring))
    engines.append(ring)
    return engines


def pipeline_pieces() -> PieceSize:
    """The pipelined all-reduces' piece size from ``collective.pipeline-bytes``, ``-pieces`` and ``-min-bytes``."""
    return PieceSize(parse_bytes(config.get("collective.pipeline-bytes")), int(config.get("collective.pipeline-pieces")),
                     parse_bytes(config.get("collective.pipeline-min-bytes")))


class PackedAllReduce:
    """Runs an ``AllReducePlan`` pack by pack, each with the first engine that accepts it.

    Parameters
    ----------
    engines
        The pack engines, in order (``pack_engines``); the last accepts every pack.
    algorithm_name
        The group's algorithm (``ring`` forces the ring for every call).
    """

    def __init__(self, engines: list[Engine], algorithm_name: str):
        self.engines = engines
        self.algorithm_name = algorithm_name

    def choose(self, plan: PackPlan) -> Engine:
        """The first engine that accepts ``plan``."""
        for engine in self.engines:
            if engine.accepts(plan):
                return engine
        raise AssertionError(f"no all-reduce engine accepts a pack of {plan.buffer.nbytes} bytes")  # pragma: no cover

    def reduce_pack(self, call: CollectiveCall, index: int, pack: Any, plan: PackPlan) -> None:
        """All-reduce one pack (``Pack``) of a collective with the engine chosen for it."""
        call.part = f"p{index}/"
        pack.buffer = self.choose(plan).run(call, plan)

    def run(self, call: CollectiveCall, plan: AllReducePlan) -> Any:
        """All-reduce every pack of ``plan``; returns the caller's structure of results."""
        packed = plan.packed
        forced_ring = PackPlan.forces_ring(self.algorithm_name, plan.options)
        for index, p in enumerate(packed.packs):
            self.reduce_pack(call, index, p, PackPlan(p.buffer, plan.op, p.borrowed, forced_ring))
        return packed.unpack()
