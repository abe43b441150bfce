"""Input options and contexts with TensorFlow's names: ``InputContext``, ``InputOptions``, ``AutoShardPolicy``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AutoShardPolicy", "InputContext", "InputOptions"]


class AutoShardPolicy(enum.Enum):
    """How ``experimental_distribute_dataset`` splits the data between replicas (TF's enum).

    ``FILE`` shards by partition (a Dask partition plays the role of a file),
    ``DATA`` lets every replica read everything and keep every n-th element,
    ``AUTO`` is FILE when there are at least as many partitions as replicas,
    else DATA, and ``OFF`` gives every replica the whole dataset.
    """

    OFF = "OFF"
    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"


@dataclass(frozen=True)
class InputOptions:
    """Options for distributing datasets (TF's ``tf.distribute.InputOptions``, the fields that apply).

    Parameters
    ----------
    experimental_fetch_to_device
        On GPU replicas, move batches to the GPU (as cupy arrays).
    experimental_per_replica_buffer_size
        Batches each replica prepares ahead of use (prefetch depth).
    auto_shard_policy
        An ``AutoShardPolicy`` (in TF it lives in ``tf.data.Options``).
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 2
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self) -> None:
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError("experimental_per_replica_buffer_size must be >= 0")
        if isinstance(self.auto_shard_policy, str):
            object.__setattr__(self, "auto_shard_policy", AutoShardPolicy[self.auto_shard_policy.upper()])


@dataclass(frozen=True)
class InputContext:
    """Where one input pipeline sits (TF's ``tf.distribute.InputContext``).

    Passed to the function of ``distribute_datasets_from_function``: the
    pipeline should read its share (``dataset.shard(num_input_pipelines,
    input_pipeline_id)``) and batch with ``get_per_replica_batch_size``.
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; ``ValueError`` when it does not divide."""
        if global_batch_size % self.num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync
