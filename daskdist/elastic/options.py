"""The strategies' ``ElasticOptions`` as elastic training carries them out: the membership-change callback."""

from __future__ import annotations

from typing import Any

from daskdist.strategy.extended.elastic_options import ElasticOptions

__all__ = ["ElasticOptions", "notify_membership_change"]


def notify_membership_change(options: ElasticOptions, event: Any) -> None:
    """Call ``options.on_membership_change(old, new)`` for a ``Recovery`` (replica counts before and after)."""
    if options.on_membership_change is None:
        return
    new = len(event.members)
    old = new + len(event.lost) + len(getattr(event, "left", ())) - len(event.admitted)
    options.on_membership_change(old, new)
