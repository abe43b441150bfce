"""``dd.compat.v1.distribute.experimental``: ``tf.compat.v1.distribute.experimental``."""

from __future__ import annotations

from daskdist.strategy.parameter_server_v1 import ParameterServerStrategyV1 as ParameterServerStrategy

__all__ = ["ParameterServerStrategy"]
