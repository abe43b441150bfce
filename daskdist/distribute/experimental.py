"""``tf.distribute.experimental``'s layout (the names daskdist implements).

``CollectiveCommunication`` is TensorFlow's older name of
``CommunicationImplementation`` (an alias there too). Strategies other issues
add (``MultiWorkerMirroredStrategy``, ``CentralStorageStrategy``,
``ParameterServerStrategy``) are one import line each here.
"""

from __future__ import annotations

from daskdist.ops import CommunicationImplementation, CommunicationOptions
from daskdist.strategy.base import ValueContext

CollectiveCommunication = CommunicationImplementation

__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ValueContext",
]
