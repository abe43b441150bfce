"""``GroupSpec``: everything a replica needs to know about its group, sent with the replica task.

The spec is made on the client. It carries the launch membership, the
client's parsed choices (all-reduce algorithm, transport, ...) and the
snapshot of every ``daskdist.*`` key taken on the client (``config``): the
one configuration policy (see ``daskdist.config``). It imports only the
bottom modules, so the client can build it without importing any worker-side
code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daskdist.group.membership import GroupId, Membership, MembershipPolicy
from daskdist.ops import Algorithm, CommunicationOptions

__all__ = ["TRANSPORTS", "GroupSpec"]

#: The values of ``daskdist.collective.transport``.
TRANSPORTS = ("auto", "shm", "socket", "dask", "ucx")


@dataclass
class GroupSpec:
    """A replica group as the client launched it.

    Parameters
    ----------
    membership
        The members at launch (generation 0); later generations come from the scheduler plugin.
    strategy_token
        The identity of the strategy that owns the group: what variable
        handles, datasets and strategies pickle. It is not the group's id, so
        handles stay valid across membership generations.
    policy
        What a membership change does: ``"fixed"`` fails the group, ``"elastic"`` re-forms it.
    config
        The client's ``daskdist.*`` settings (``daskdist.config.snapshot()``), the only ones replicas read.
    """

    membership: Membership
    strategy_token: str
    policy: MembershipPolicy = "fixed"
    algorithm: Algorithm = field(default_factory=Algorithm)
    options: CommunicationOptions = field(default_factory=CommunicationOptions)
    transport: str = "auto"
    shm_slot_bytes: int = 2 << 20
    single_copy_bytes: int | None = 1 << 20  # ``collective.shm.single-copy-bytes`` as the client saw it
    pin_cores: Any = "auto"  # ``daskdist.replica.pin-cores`` as the client saw it
    malloc: Any = "auto"  # ``daskdist.replica.malloc`` as the client saw it
    nccl: Any = "auto"  # ``daskdist.collective.nccl`` as the client saw it
    config: dict[str, Any] = field(default_factory=dict)
    secret: str = ""  # what the client presents on the direct command channel (``daskdist.client.command-channel``)

    @property
    def group_id(self) -> GroupId:
        return self.membership.group_id

    @property
    def addresses(self) -> list[str]:
        return self.membership.addresses

    @property
    def devices(self) -> list[str]:
        return self.membership.devices

    @property
    def hosts(self) -> list[str]:
        return self.membership.hosts

    @property
    def size(self) -> int:
        return self.membership.size
