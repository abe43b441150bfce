"""The replica task's entry point, importable by the client without importing the worker side.

The strategies hand ``run_replica`` to their ``ReplicaGroup``
(``replica_task``), which submits it pinned to each member's worker; it
imports the replica runtime only there, when the task runs. The group handle
never names it: ``daskdist.group`` sits below the replica runtime.
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
