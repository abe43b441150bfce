"""Reduction operators, communication options (TensorFlow's names and semantics) and the all-reduce choice.

``Algorithm`` is the value ``CrossDeviceOps`` turns into and the group spec
carries to the replicas; it lives here, below both, so the client never
imports the collective layer to name it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Algorithm", "CommunicationImplementation", "CommunicationOptions", "ReduceOp"]


class ReduceOp(enum.Enum):
    """How values from the replicas are combined.

    ``SUM`` and ``MEAN`` are TensorFlow's; ``MAX``, ``MIN`` and ``PRODUCT`` are
    extras. ``ReduceOp("SUM")`` and ``ReduceOp.from_any("sum")`` accept strings.
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"
    PRODUCT = "PRODUCT"

    @classmethod
    def from_any(cls, value: ReduceOp | str) -> ReduceOp:
        """Return the ``ReduceOp`` for an enum member or its (case-insensitive) name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        names = ", ".join(member.name for member in cls)
        raise ValueError(f"Unknown reduce op {value!r}; expected a ReduceOp or one of {names}")


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use (TF's ``CommunicationImplementation``).

    ``AUTO`` lets daskdist choose by size and transport; ``RING`` forces the ring
    algorithm; ``NCCL`` asks for NCCL and falls back to ``RING`` for arrays that
    are not on a GPU, as TensorFlow does.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclass(frozen=True)
class CommunicationOptions:
    """Options for one collective (TF's ``tf.distribute.experimental.CommunicationOptions``).

    Parameters
    ----------
    bytes_per_pack
        Tensors are fused into packs of about this many bytes before they are
        reduced; ``0`` lets daskdist choose (one pack per dtype).
    timeout_seconds
        Deadline of the collective; ``None`` uses ``daskdist.collective.timeout``.
        When it passes, every replica raises ``CollectiveTimeoutError`` naming
        the replicas that did not join.
    implementation
        A ``CommunicationImplementation`` or its name.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative int, got {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive or None, got {self.timeout_seconds!r}")
        if isinstance(self.implementation, str):
            try:
                impl = CommunicationImplementation[self.implementation.upper()]
            except KeyError:
                raise ValueError(f"Unknown implementation {self.implementation!r}") from None
            object.__setattr__(self, "implementation", impl)
        elif not isinstance(self.implementation, CommunicationImplementation):
            raise TypeError(f"implementation must be a CommunicationImplementation, got {self.implementation!r}")

    def merge(self, other: CommunicationOptions | None) -> CommunicationOptions:
        """Return these options with every non-default field of ``other`` applied on top."""
        if other is None:
            return self
        return CommunicationOptions(
            bytes_per_pack=other.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=other.timeout_seconds if other.timeout_seconds is not None else self.timeout_seconds,
            implementation=(
                other.implementation
                if other.implementation is not CommunicationImplementation.AUTO
                else self.implementation
            ),
        )


class Algorithm:
    """How all-reduce is done for a group (set from ``cross_device_ops``).

    Parameters
    ----------
    name
        ``"auto"``, ``"ring"``, ``"direct"``, ``"reduce_to_one"`` or ``"hierarchical"``.
    num_packs
        Packs per dtype (``NcclAllReduce`` / ``HierarchicalCopyAllReduce``).
    root
        Rank that reduces for ``"reduce_to_one"``.
    accumulation_fn
        Optional sum of a list of arrays for ``"reduce_to_one"``.
    """

    def __init__(self, name: str = "auto", num_packs: int = 1, root: int = 0,
                 accumulation_fn: Callable[[Sequence[Any]], Any] | None = None):
        if name not in ("auto", "ring", "direct", "reduce_to_one", "hierarchical"):
            raise ValueError(f"Unknown all-reduce algorithm {name!r}")
        self.name = name
        self.num_packs = num_packs
        self.root = root
        self.accumulation_fn = accumulation_fn

    def __repr__(self) -> str:
        return f"Algorithm({self.name!r}, num_packs={self.num_packs}, root={self.root})"
