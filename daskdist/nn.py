"""Loss scaling for custom training loops (TF's ``tf.nn.compute_average_loss``) and ``embedding_lookup``."""

from __future__ import annotations

from typing import Any

from daskdist import context
from daskdist.arrays import as_array, namespace
from daskdist.variables.sharded import embedding_lookup

__all__ = ["compute_average_loss", "embedding_lookup"]


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None, global_batch_size: int | None = None) -> Any:
    """Sum of the per-example losses divided by the *global* batch size.

    Inside a replica, summing this over the replicas (``all_reduce(SUM)`` of
    the gradients, as ``MirroredStrategy`` does) gives the mean over the
    global batch. ``global_batch_size`` defaults to the local batch size
    times ``num_replicas_in_sync``.
    """
    losses, _ = as_array(per_example_loss)
    xp = namespace(losses)
    if sample_weight is not None:
        weights, _ = as_array(sample_weight)
        losses = losses * weights
    if global_batch_size is None:
        ctx = context.get_replica_context()
        replicas = ctx.num_replicas_in_sync if ctx is not None else 1
        global_batch_size = (losses.shape[0] if losses.ndim else 1) * replicas
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return xp.sum(losses) / losses.dtype.type(global_batch_size)
