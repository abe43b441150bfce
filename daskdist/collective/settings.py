"""Parsing of the collective layer's settings, importable by the client without any transport or engine.

The client checks these when it builds a group's spec (a bad value fails
there, not on the workers); the replicas parse the same snapshot.
"""

from __future__ import annotations

from typing import Any

from dask.utils import parse_bytes

__all__ = ["parse_nccl_setting", "parse_single_copy_bytes"]


def parse_nccl_setting(value: Any) -> bool:
    """``daskdist.collective.nccl`` as a bool: ``auto`` (use NCCL where it works) or ``false``.

    Raises
    ------
    ValueError
        Any other value.
    """
    if value in (False, None) or (isinstance(value, str) and value.lower() in ("false", "off", "no")):
        return False
    if value is True or (isinstance(value, str) and value.lower() in ("auto", "true", "on", "yes")):
        return True
    raise ValueError(f"daskdist.collective.nccl must be 'auto' or false, got {value!r}")


def parse_single_copy_bytes(value: Any) -> int | None:
    """``daskdist.collective.shm.single-copy-bytes`` in bytes; ``None`` when switched off (null, 0 or false)."""
    if value in (None, False, 0, "0", "off", "false"):
        return None
    return int(parse_bytes(value)) if isinstance(value, str) else int(value)
