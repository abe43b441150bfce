"""``dd.compat.v1``: TensorFlow 1 names (``tf.compat.v1``)."""

from __future__ import annotations

from daskdist.compat.v1 import distribute

__all__ = ["distribute"]
