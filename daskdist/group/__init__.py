"""Replica groups: membership and generations, the client's handle, the scheduler and worker plugins.

``membership`` (the bottom: ids, ``Member``, ``Membership``), ``spec`` (what
a replica is launched with), ``handle`` (the client's ``ReplicaGroup``),
``scheduler_plugin`` and ``worker_plugin`` (the Dask plugins), ``service``
(the replica service protocol and its resident store), ``launch`` (the
replica task's entry point).
"""

from __future__ import annotations

from daskdist.group.membership import Generation, GroupId, Member, Membership, Rank, RunId

__all__ = ["Generation", "GroupId", "Member", "Membership", "Rank", "RunId"]
