"""``dd.experimental.coordinator``: TF's ``tf.distribute.experimental.coordinator`` (``tf.distribute.coordinator``)."""

from __future__ import annotations

from daskdist.coordinator.cluster_coordinator import (
    ClusterCoordinator,
    ParameterServerLostError,
    PerWorkerValues,
    RemoteValue,
    RemoteValueStatus,
)

__all__ = ["ClusterCoordinator", "ParameterServerLostError", "PerWorkerValues", "RemoteValue", "RemoteValueStatus"]
