"""Lightning on daskdist: ``DaskdistEnvironment``, a ``ClusterEnvironment`` of the replica group.

Inside a function that ``strategy.run`` runs on the replicas::

    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from daskdist.plugins.lightning import DaskdistEnvironment

    def train():
        environment = DaskdistEnvironment()      # daskdist's torch group for this replica
        trainer = Trainer(accelerator="cpu", devices=environment.local_world_size(),
                          num_nodes=environment.num_nodes(),
                          strategy=DDPStrategy(process_group_backend="daskdist",
                                               cluster_environment=environment))
        trainer.fit(module, loader)

The module imports Lightning only when ``DaskdistEnvironment`` is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DaskdistEnvironment"]


def __getattr__(name: str) -> Any:
    """``DaskdistEnvironment`` loads on first use (it imports Lightning and torch)."""
    if name == "DaskdistEnvironment":
        from daskdist.plugins.lightning.environment import DaskdistEnvironment

        return DaskdistEnvironment
    raise AttributeError(f"module 'daskdist.plugins.lightning' has no attribute {name!r}")
