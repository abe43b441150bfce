"""``tf.distribute.experimental``'s layout (the names daskdist implements).

``CollectiveCommunication`` is TensorFlow's older name of
``CommunicationImplementation`` (an alias there too). ``MultiWorkerMirroredStrategy``
here is TF's deprecated ``(communication, cluster_resolver)`` form: instances of
``distribute.MultiWorkerMirroredStrategy`` pass ``isinstance`` checks against it. Strategies other issues
add (``MultiWorkerMirroredStrategy``, ``CentralStorageStrategy``,
``ParameterServerStrategy``) are one import line each here.
"""

from __future__ import annotations

from daskdist.experimental import coordinator, partitioners
from daskdist.ops import CommunicationImplementation, CommunicationOptions
from daskdist.strategy.central_storage import CentralStorageStrategy
from daskdist.strategy.extended.options import ValueContext
from daskdist.strategy.multi_worker_mirrored import (
    MultiWorkerMirroredStrategyExperimental as MultiWorkerMirroredStrategy,
)
from daskdist.strategy.parameter_server import ParameterServerStrategy

CollectiveCommunication = CommunicationImplementation

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "ValueContext",
    "coordinator",
    "partitioners",
]
