"""Elastic training: a lost worker no longer ends training (opt-in with ``ElasticOptions``).

``options`` (``ElasticOptions``), ``replica`` (the commit ring and the
replica-side commands), ``ledger`` (which rows each committed step
consumed), ``epochs`` (each epoch's row order and global batch), ``recovery`` (re-formed group, enough members, one commit),
``session`` (one elastic run of epochs: what every trainer's elastic ``fit`` shares), ``fit`` (the built-in
layers' ``Model.fit`` on an elastic strategy), ``state`` (``State`` and ``run``, for custom loops). See ``docs/elastic.md``.
"""

from __future__ import annotations

from typing import Any

from daskdist.elastic.options import ElasticOptions

__all__ = ["ElasticOptions", "State", "run"]


def __getattr__(name: str) -> Any:
    """``State`` and ``run`` load on first use (they import the data and keras layers)."""
    if name in ("State", "run"):
        from daskdist.elastic import state

        return getattr(state, name)
    raise AttributeError(f"module 'daskdist.elastic' has no attribute {name!r}")
