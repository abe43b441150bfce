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

__all__ = ["NO_DEADLINE_SECONDS", "Algorithm", "CommunicationImplementation", "CommunicationOptions", "ReduceOp",
           "timeout_of"]

#: What ``timeout_seconds=0`` (TensorFlow: "zero disables timeout") waits: a year, not forever, so every
#: deadline stays a finite ``time.monotonic()`` value.
NO_DEADLINE_SECONDS = 365 * 24 * 3600.0


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

    As in TensorFlow they are hints: an option that does not apply to a
    collective or a strategy is ignored. Passed to a strategy (its
    ``communication_options``) they are the defaults of its collectives; passed
    to one collective, its fields that are not defaults override those
    (``merge``).

    Parameters
    ----------
    bytes_per_pack
        A non-negative int: the arrays of one all-reduce are fused into packs
        of about this many bytes; ``0`` lets daskdist choose (one pack per
        dtype, split by the group's ``num_packs``). As in TensorFlow.
    timeout_seconds
        Deadline of the collective, in seconds. ``0`` disables it, as in
        TensorFlow (the collective still fails at once when a replica is
        lost or is known to have skipped it, and still warns when it stalls).
        ``None``: ``daskdist.collective.timeout`` (300 s), where TensorFlow
        waits forever; when it passes, every replica raises
        ``CollectiveTimeoutError`` (TensorFlow: ``DeadlineExceededError``;
        ours is a ``TimeoutError``) naming the replicas that did not join.
    implementation
        A ``CommunicationImplementation`` or its name: ``AUTO`` (daskdist
        chooses), ``RING`` (the ring algorithm) or ``NCCL`` (GPU arrays
        through NCCL; others take the ring, as TensorFlow falls back).
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative int, got {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and (isinstance(self.timeout_seconds, bool)
                                                 or not isinstance(self.timeout_seconds, (int, float))
                                                 or not self.timeout_seconds >= 0):
            raise ValueError(f"timeout_seconds must be a number >= 0 (0: no deadline) or None, "
                             f"got {self.timeout_seconds!r}")
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


def timeout_of(timeout_seconds: float | None, default: float) -> float:
    """The seconds a collective with ``timeout_seconds`` waits: ``default`` for ``None``, a year for ``0``."""
    if timeout_seconds is None:
        return default
    return float(timeout_seconds) if timeout_seconds > 0 else NO_DEADLINE_SECONDS


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
