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
from daskdist.values import DistributedValues, Mirrored, PerReplica, local_results, reduce_values
from daskdist.variables.distributed import Variable

__all__ = [
    "AllReduceCrossDeviceOps",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "destination_count",
    "validate_destinations",
]


def validate_destinations(destinations: Any) -> None:
    """Raise ``ValueError`` unless ``destinations`` names where a reduced value goes (TF's ``validate_destinations``).

    Accepted: a ``DistributedValues`` or a variable (every device it lives
    on), a non-empty device string, or an array (the process holding it).
    """
    if isinstance(destinations, str):
        if not destinations:
            raise ValueError("destinations can not be empty")
        return
    if isinstance(destinations, (DistributedValues, Variable)) or hasattr(destinations, "__array__") or hasattr(
        destinations, "__dlpack__"
    ):
        return
    raise ValueError("destinations must be one of a `DistributedValues` object, a tf.Variable object, or a "
                     f"device string (got {type(destinations).__name__})")


def destination_count(destinations: Any) -> int:
    """On how many devices ``destinations`` lives: its components (a distributed value or variable), else one."""
    if isinstance(destinations, DistributedValues):
        return len(destinations)
    if isinstance(destinations, Variable):
        return len(local_results(destinations))
    return 1


def _on_destinations(value: Any, destinations: Any) -> Any:
    """``value`` on every device of ``destinations``: a ``Mirrored`` over several, the value on one.

    TF's ``simple_broadcast`` then ``regroup``, which unwraps a single copy.
    """
    count = destination_count(destinations)
    return value if count == 1 else Mirrored([value] * count)


class CrossDeviceOps:
    """Base class: how replicas' values are reduced."""

    def algorithm(self, devices: Sequence[DeviceSpec]) -> Algorithm:
        """The all-reduce algorithm for a group on ``devices`` (rank order)."""
        return Algorithm()

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None) -> Any:
        """Reduce a ``PerReplica`` value the client holds onto ``destinations`` (TF's ``CrossDeviceOps.reduce``).

        Parameters
        ----------
        reduce_op
            ``ReduceOp`` or its name.
        per_replica_value
            A ``PerReplica`` (or ``Mirrored``); any other value counts as one
            replica's.
        destinations
            A ``DistributedValues`` or variable (the result goes to each of its
            devices), a device string or an array (one device).

        Returns
        -------
        A ``Mirrored`` with one copy of the reduced value per destination
        device when there are several, else the reduced value.

        Raises
        ------
        ValueError
            ``destinations`` is none of those (TF's ``validate_destinations``).
        """
        validate_destinations(destinations)
        if not isinstance(per_replica_value, DistributedValues):
            per_replica_value = PerReplica((per_replica_value,))
        reduced = reduce_values(reduce_op, per_replica_value, None, len(per_replica_value))
        return _on_destinations(reduced, destinations)

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                     options: CommunicationOptions | None = None) -> list[Any]:
        """``reduce`` of each ``(per_replica_value, destinations)`` pair, in order (TF's ``batch_reduce``)."""
        pairs = list(value_destination_pairs)
        for _, destinations in pairs:
            validate_destinations(destinations)
        return [self.reduce(reduce_op, v, d, options) for v, d in pairs]

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """``tensor`` on every device of ``destinations`` (TF's ``CrossDeviceOps.broadcast``).

        A ``Mirrored`` over several devices; on one device, ``tensor`` itself
        (TF's regroup unwraps a single copy).
        """
        validate_destinations(destinations)
        return _on_destinations(tensor, destinations)

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

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None) -> Any:
        """``CrossDeviceOps.reduce`` with ``accumulation_fn`` summing the components, when given (TF's ``_simple_reduce``).

        Raises
        ------
        ValueError
            With ``accumulation_fn``, a ``reduce_op`` other than SUM or MEAN.
        """
        if self.accumulation_fn is None:
            return super().reduce(reduce_op, per_replica_value, destinations, options)
        validate_destinations(destinations)
        op = ReduceOp.from_any(reduce_op)
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise ValueError("`reduce_op` must be Reduce.SUM or Reduce.MEAN.")
        components = list(per_replica_value.values if isinstance(per_replica_value, DistributedValues)
                          else (per_replica_value,))
        reduced = self.accumulation_fn(components)
        if op is ReduceOp.MEAN:
            reduced = reduced / len(components)
        return _on_destinations(reduced, destinations)

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
