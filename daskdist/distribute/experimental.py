"""``tf.distribute.experimental``'s layout (the names daskdist implements).

``CollectiveCommunication`` is TensorFlow's older name of
``CommunicationImplementation`` (an alias there too). ``MultiWorkerMirroredStrategy``
here is TF's deprecated ``(communication, cluster_resolver)`` form: instances of
``distribute.MultiWorkerMirroredStrategy`` pass ``isinstance`` checks against it. Strategies other issues
add (``MultiWorkerMirroredStrategy``, ``CentralStorageStrategy``,
``ParameterServerStrategy``) are one import line each here.
"""

from __future__ import annotations

from daskdist.ops import CommunicationImplementation, CommunicationOptions
from daskdist.strategy.base import ValueContext
from daskdist.strategy.multi_worker_mirrored import (
    MultiWorkerMirroredStrategyExperimental as MultiWorkerMirroredStrategy,
)

CollectiveCommunication = CommunicationImplementation

__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ValueContext",
]
