"""PyTorch on daskdist: a ``torch.distributed`` backend, and helpers for a hand-written loop.

Backend (stock ``DistributedDataParallel``, ``dist.*``, ``SyncBatchNorm``,
``ZeroRedundancyOptimizer``)::

    def train(dist_dataset):
        dd.plugins.torch.init_process_group()          # backend "daskdist", rank = replica id
        model = torch.nn.parallel.DistributedDataParallel(Net())
        ...

    strategy.run(train, args=(strategy.experimental_distribute_dataset(ds),))

A model that lives on the replicas between ``strategy.run`` calls and that
elastic commits keep: ``TorchModel(strategy, build)`` (``model.py``; its
``ddp()`` re-wraps at each membership generation).

Helpers: ``broadcast_parameters`` / ``allreduce_gradients`` (one fused
all-reduce after ``backward()``). torch is imported only when the backend is
used (``import daskdist`` never imports it).
"""

from __future__ import annotations

from typing import Any

from daskdist.plugins.torch.helpers import allreduce_gradients, broadcast_parameters, set_malloc_options

__all__ = ["TorchModel", "allreduce_gradients", "broadcast_parameters", "destroy_process_group",
           "init_process_group", "register_backend", "set_malloc_options"]


def __getattr__(name: str) -> Any:
    """``TorchModel`` loads on first use (it imports torch)."""
    if name == "TorchModel":
        from daskdist.plugins.torch.model import TorchModel

        return TorchModel
    raise AttributeError(f"module 'daskdist.plugins.torch' has no attribute {name!r}")


def init_process_group(*args: Any, **kwargs: Any) -> Any:
    """Initialise ``torch.distributed`` on the ``daskdist`` backend in this replica; its default group (see ``backend``)."""
    from daskdist.plugins.torch import backend

    return backend.init_process_group(*args, **kwargs)


def destroy_process_group() -> None:
    """Destroy the group ``init_process_group`` made in this process, if any."""
    from daskdist.plugins.torch import backend

    backend.destroy_process_group()


def register_backend() -> None:
    """Register ``"daskdist"`` with ``torch.distributed.Backend`` (idempotent)."""
    from daskdist.plugins.torch import backend

    backend.register_backend()
