"""Train a PyTorch module's parameters with daskdist's all-reduce (tensors pass through DLPack).

Inside a function run on the replicas (``strategy.run``), each replica holds
its own copy of the module. Call ``broadcast_parameters`` once so every copy
starts from replica 0's weights, then after each ``loss.backward()`` call
``allreduce_gradients``: all gradients travel in one fused all-reduce and come
back as torch tensors (CPU tensors are viewed as numpy arrays through DLPack,
without a copy). The optimizer then takes the same step on every replica.

A step's tensors keep their memory from one step to the next: replicas set
glibc's ``malloc`` options of their worker process when they start
(``daskdist.replica.malloc``, see ``daskdist.replica.allocator``;
``set_malloc_options`` is re-exported here for standalone processes).

Example::

    def train(dist):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dd.plugins.torch.broadcast_parameters(model)
        for x, y in dist:                       # this replica's shard
            opt.zero_grad()
            loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            dd.plugins.torch.allreduce_gradients(model)
            opt.step()
        return float(loss)

    strategy.run(train, args=(strategy.experimental_distribute_dataset(ds),))
"""

from __future__ import annotations

from typing import Any

from daskdist import context
from daskdist.ops import ReduceOp
from daskdist.replica.allocator import set_malloc_options

__all__ = ["allreduce_gradients", "broadcast_parameters", "set_malloc_options"]


def _parameters(module: Any) -> list[Any]:
    return [p for p in module.parameters() if p.requires_grad]


def allreduce_gradients(module: Any, op: ReduceOp | str = ReduceOp.MEAN, options: Any = None) -> None:
    """Replace every parameter's ``.grad`` by its all-reduce over the replicas (MEAN by default).

    Parameters without a gradient (unused in this step) contribute zeros, so
    every replica joins the same collective with the same structure. All
    gradients go in one call of ``ReplicaContext.all_reduce`` (packed into a
    few buffers). Outside a replica, or with one replica, nothing changes.

    Parameters
    ----------
    module
        A ``torch.nn.Module`` whose trainable parameters have this step's gradients.
    op
        ``ReduceOp.MEAN`` (default) or ``SUM`` (or another op, or its name).
    options
        ``CommunicationOptions`` for the all-reduce.
    """
    import torch

    ctx = context.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return
    params = _parameters(module)
    grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in params]
    reduced = ctx.all_reduce(op, grads, options)
    with torch.no_grad():
        for p, g in zip(params, reduced):
            if p.grad is None:
                p.grad = torch.as_tensor(g).clone()
            else:
                p.grad.copy_(torch.as_tensor(g))


def broadcast_parameters(module: Any, root: int = 0) -> None:
    """Copy replica ``root``'s parameters and buffers into every replica's module.

    Parameters
    ----------
    module
        A ``torch.nn.Module``, the same architecture on every replica.
    root
        The replica whose values every replica gets.
    """
    import torch

    ctx = context.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return
    tensors = [t.detach() for t in module.state_dict().values()]
    received = ctx.broadcast([t.contiguous() for t in tensors], root=root)
    with torch.no_grad():
        for t, r in zip(tensors, received):
            t.copy_(torch.as_tensor(r))
