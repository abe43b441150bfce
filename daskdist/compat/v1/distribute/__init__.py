"""``dd.compat.v1.distribute``: ``tf.compat.v1.distribute``."""

from __future__ import annotations

from daskdist.compat.v1.distribute import experimental

__all__ = ["experimental"]
