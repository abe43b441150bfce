"""Checkpoint helpers with TensorFlow's names: ``dd.train.latest_checkpoint``."""

from __future__ import annotations

from daskdist.keras.saving import latest_checkpoint

__all__ = ["latest_checkpoint"]
