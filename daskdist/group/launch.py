"""The replica task's entry point, importable by the client without importing the worker side.

``ReplicaGroup.launch`` submits ``run_replica`` pinned to each member's
worker; it imports the replica runtime only there, when the task runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daskdist.group.spec import GroupSpec

__all__ = ["run_replica"]


def run_replica(spec: GroupSpec, rank: int) -> str:
    """Body of the long-lived replica task (``daskdist.replica.runtime.replica_main``)."""
    from daskdist.replica.runtime import replica_main  # worker side: imported where the replica runs

    return replica_main(spec, rank)
