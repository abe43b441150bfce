"""Parsing of the collective layer's size settings, importable by the client without any transport or engine.

The client checks these when it builds a group's spec (a bad value fails
there, not on the workers); the replicas parse the same snapshot. NCCL's
setting is parsed by ``nccl_support.parse_setting`` (equally free of transports).
"""

from __future__ import annotations

from typing import Any

from dask.utils import parse_bytes

__all__ = ["parse_single_copy_bytes"]


def parse_single_copy_bytes(value: Any) -> int | None:
    """``daskdist.collective.shm.single-copy-bytes`` in bytes; ``None`` when switched off (null, 0 or false)."""
    if value in (None, False, 0, "0", "off", "false"):
        return None
    return int(parse_bytes(value)) if isinstance(value, str) else int(value)
