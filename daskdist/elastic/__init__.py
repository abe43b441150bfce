"""Elastic training: a lost worker no longer ends training (opt-in with ``ElasticOptions``).

``options`` (``ElasticOptions``), ``replica`` (the commit ring and the
replica-side commands), ``ledger`` (which rows each committed step
consumed), ``recovery`` (re-formed group, enough members, one commit) and
``fit`` (``keras.Model.fit`` on an elastic strategy). See ``docs/elastic.md``.
"""

from __future__ import annotations

from daskdist.elastic.options import ElasticOptions

__all__ = ["ElasticOptions"]
