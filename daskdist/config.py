"""daskdist's defaults in ``dask.config`` (``daskdist.*`` keys, ``DASK_DASKDIST__...`` env vars)."""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

__all__ = ["get", "get_seconds"]

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "daskdist.yaml")

with open(_DEFAULTS_FILE) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)


def get(key: str, default: Any = None) -> Any:
    """Read ``daskdist.<key>`` from ``dask.config``."""
    return dask.config.get(f"daskdist.{key}", default)


def get_seconds(key: str) -> float:
    """Read a duration key (``"60s"``, ``"2 minutes"`` or a number) as seconds."""
    from dask.utils import parse_timedelta

    value = get(key)
    seconds = parse_timedelta(value, default="seconds")
    if seconds is None:
        raise ValueError(f"daskdist.{key} must be a duration, got {value!r}")
    return float(seconds)
