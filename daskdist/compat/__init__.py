"""``dd.compat``: TensorFlow's ``tf.compat`` names that daskdist implements."""

from __future__ import annotations

from daskdist.compat import v1

__all__ = ["v1"]
