"""``dd.experimental``: TensorFlow's ``tf.distribute.experimental`` names."""

from __future__ import annotations

from daskdist.strategy.central_storage import CentralStorageStrategy

__all__ = ["CentralStorageStrategy"]
