"""TensorFlow's ``cross_device_ops`` classes, mapped onto daskdist's collective algorithms.

``MirroredStrategy(cross_device_ops=...)`` accepts these with TF's
constructor arguments. They choose the all-reduce algorithm every replica
uses; the transport underneath is chosen separately
(``daskdist.collective.transport``).

========================== ===================================================
TF class                   daskdist algorithm
========================== ===================================================
``NcclAllReduce``           ring all-reduce in ``num_packs`` packs (NCCL for GPU
                            arrays when that transport is available)
``HierarchicalCopyAllReduce`` hierarchical all-reduce (within each host, then
                            across hosts) in ``num_packs`` packs; the ring on one host
``ReductionToOneDevice``    gather on one replica, reduce with
                            ``accumulation_fn``, send the result back
========================== ===================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from daskdist.cluster.devices import DeviceSpec, parse_device
from daskdist.ops import Algorithm, CommunicationOptions, ReduceOp
from daskdist.values import reduce_values

__all__ = [
    "AllReduceCrossDeviceOps",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
]


class CrossDeviceOps:
    """Base class: how replicas' values are reduced."""

    def algorithm(self, devices: Sequence[DeviceSpec]) -> Algorithm:
        """The all-reduce algorithm for a group on ``devices`` (rank order)."""
        return Algorithm()

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any = None,
               options: CommunicationOptions | None = None) -> Any:
        """Reduce a ``PerReplica`` value held by the client (cross-replica context)."""
        num = len(getattr(per_replica_value, "values", (per_replica_value,)))
        return reduce_values(reduce_op, per_replica_value, None, num)

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                     options: CommunicationOptions | None = None) -> list[Any]:
        return [self.reduce(reduce_op, v, d, options) for v, d in value_destination_pairs]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce on one device, then copy the result to all (TF's ``ReductionToOneDevice``).

    Parameters
    ----------
    reduce_to_device
        The device (one of the strategy's) that reduces; default: the first.
    accumulation_fn
        ``fn(list_of_arrays) -> array`` summing the replicas' values, in rank
        order; default: element-wise addition.
    """

    def __init__(self, reduce_to_device: str | None = None,
                 accumulation_fn: Callable[[Sequence[Any]], Any] | None = None):
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn
        self._target = parse_device(reduce_to_device) if reduce_to_device is not None else None

    def algorithm(self, devices: Sequence[DeviceSpec]) -> Algorithm:
        root = 0
        if self._target is not None:
            if self._target not in devices:
                raise ValueError(
                    f"reduce_to_device {self.reduce_to_device!r} is not one of the strategy's devices "
                    f"({', '.join(str(d) for d in devices)})"
                )
            root = list(devices).index(self._target)
        return Algorithm("reduce_to_one", root=root, accumulation_fn=self.accumulation_fn)

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"


class AllReduceCrossDeviceOps(CrossDeviceOps):
    """All-reduce in ``num_packs`` packs per dtype (TF's ``AllReduceCrossDeviceOps``).

    Parameters
    ----------
    all_reduce_alg
        ``"nccl"`` or ``"hierarchical_copy"`` (both use the ring on CPU arrays).
    num_packs
        Packs per dtype the values are fused into; ``0`` sends each tensor alone.
    """

    def __init__(self, all_reduce_alg: str = "nccl", num_packs: int = 1):
        if all_reduce_alg not in ("nccl", "hierarchical_copy"):
            raise ValueError(f"all_reduce_alg must be 'nccl' or 'hierarchical_copy', got {all_reduce_alg!r}")
        if not isinstance(num_packs, int) or num_packs < 0:
            raise ValueError(f"num_packs must be a non-negative int, got {num_packs!r}")
        self.all_reduce_alg = all_reduce_alg
        self.num_packs = num_packs

    def algorithm(self, devices: Sequence[DeviceSpec]) -> Algorithm:
        name = "hierarchical" if self.all_reduce_alg == "hierarchical_copy" else "ring"
        return Algorithm(name, num_packs=self.num_packs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"


class NcclAllReduce(AllReduceCrossDeviceOps):
    """TF's ``NcclAllReduce(num_packs=1)``; on CPU arrays it falls back to the ring, as TF does."""

    def __init__(self, num_packs: int = 1):
        super().__init__("nccl", num_packs)


class HierarchicalCopyAllReduce(AllReduceCrossDeviceOps):
    """TF's ``HierarchicalCopyAllReduce(num_packs=1)``."""

    def __init__(self, num_packs: int = 1):
        super().__init__("hierarchical_copy", num_packs)
