"""``DaskdistEnvironment``: where a replica stands in its group, as Lightning's ``ClusterEnvironment`` asks.

Lightning's ``DDPStrategy`` asks its cluster environment for the process's
global rank, the world size, the local rank and the node rank, then
initialises ``torch.distributed`` unless something did already. Made inside a
replica, ``DaskdistEnvironment`` initialises daskdist's torch group for it
(``dd.plugins.torch.init_process_group()``, unless the replica's code did), so
Lightning finds the group made and its DDP runs on the ``daskdist`` backend. The
answers come from the group's membership: the rank and size of the replica
group, a node is a host (``LOCAL_RANK`` is the replica's position on its host,
``node_rank`` the host's position). The processes exist already (the
replicas): Lightning starts none. The group met through the Dask scheduler,
so ``main_port`` is 0 and nothing listens on it.

Lightning computes each process's rank as ``node_rank * devices + local_rank``
and checks nothing; this environment refuses (``set_global_rank``,
``set_world_size``) a ``Trainer(devices=..., num_nodes=...)`` whose ranks would
not be the group's, naming the values that fit.
"""

from __future__ import annotations

import logging

from lightning.fabric.plugins.environments import ClusterEnvironment

from daskdist import context
from daskdist.plugins.torch import backend
from daskdist.plugins.torch.environment import torchrun_environment

__all__ = ["DaskdistEnvironment"]

logger = logging.getLogger(__name__)


class DaskdistEnvironment(ClusterEnvironment):
    """A Lightning ``ClusterEnvironment`` for the replica that makes it (inside ``strategy.run``).

    Raises
    ------
    RuntimeError
        Made outside a function run on the replicas (as ``init_process_group``).
    """

    def __init__(self) -> None:
        runtime = context.current_runtime()
        if runtime is None:
            raise RuntimeError("DaskdistEnvironment() must be made inside a function run on the replicas "
                               "(strategy.run(fn)): it describes the replica that makes it")
        if not backend.is_current(runtime):
            backend.init_process_group()
        members = runtime.membership
        self._placement = torchrun_environment(int(runtime.rank), members.hosts, members.addresses)
        self._generation = runtime.generation

    def _number(self, name: str) -> int:
        return int(self._placement[name])

    @property
    def creates_processes_externally(self) -> bool:
        """True: the replicas are the processes; Lightning starts none."""
        return True

    @property
    def main_address(self) -> str:
        """Rank 0's host (the group met already; Lightning only writes it to ``MASTER_ADDR``)."""
        return self._placement["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        """0: the group met through the Dask scheduler and listens on no port."""
        return 0

    @staticmethod
    def detect() -> bool:
        """Whether this thread runs a replica's function (Lightning never picks this environment by itself)."""
        return context.current_runtime() is not None

    def world_size(self) -> int:
        """The replicas in the group."""
        return self._number("WORLD_SIZE")

    def set_world_size(self, size: int) -> None:
        """Lightning's ``num_nodes * devices``: it must be the group's size."""
        if size != self.world_size():
            raise ValueError(f"Lightning's Trainer asks for {size} processes (num_nodes * devices) but the daskdist "
                             f"group has {self.world_size()} replicas; use {self._fitting_trainer()}")

    def global_rank(self) -> int:
        """The replica's rank in the group."""
        return self._number("RANK")

    def set_global_rank(self, rank: int) -> None:
        """Lightning's ``node_rank * devices + local_rank``: it must be the replica's rank."""
        if rank != self.global_rank():
            raise ValueError(f"Lightning numbers this replica {rank} (node_rank * devices + local_rank) but its "
                             f"rank in the daskdist group is {self.global_rank()}; use {self._fitting_trainer()}, "
                             "and on several hosts a group whose ranks are contiguous per host")

    def local_rank(self) -> int:
        """The replica's position among the group's members on its host."""
        return self._number("LOCAL_RANK")

    def node_rank(self) -> int:
        """The position of the replica's host among the group's hosts."""
        return self._number("GROUP_RANK")

    def local_world_size(self) -> int:
        """The group's members on this replica's host (``Trainer(devices=...)``)."""
        return self._number("LOCAL_WORLD_SIZE")

    def num_nodes(self) -> int:
        """The group's hosts (``Trainer(num_nodes=...)``)."""
        return self._number("GROUP_WORLD_SIZE")

    def _fitting_trainer(self) -> str:
        return f"Trainer(devices={self.local_world_size()}, num_nodes={self.num_nodes()})"

    def teardown(self) -> None:
        """Nothing: the torch group is the replica's, destroyed when it closes."""
