"""Input options and contexts with TensorFlow's names: ``InputContext``, ``InputOptions``, ``AutoShardPolicy``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AutoShardPolicy", "InputContext", "InputOptions"]


class AutoShardPolicy(enum.Enum):
    """How ``experimental_distribute_dataset`` splits the data between replicas (TF's enum).

    A Dask partition plays the role of a file. Rows of Dask partitions can be addressed, so ``AUTO``, ``FILE`` and
    ``DATA`` all split rows as ``InputOptions.experimental_split`` says
    (``FILE`` still refuses fewer partitions than replicas, as TF refuses
    fewer files than workers); ``OFF`` gives every replica the whole dataset.
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
    experimental_split
        Which rows each replica reads (not in TF, whose devices share one host's memory). ``None`` (the
        default) chooses by the source: ``"balanced"`` for Dask collections (the data stays on the workers
        that hold it), ``"global"`` for rows held in the client's memory (``from_tensor_slices``, numpy),
        and for elastic training's seeded epoch order.

        ``"global"`` (TF's semantics)
            step ``k`` holds exactly the undistributed dataset's batch ``k``,
            split over the replicas with TF's rule (the first replicas get
            ``ceil(b / n)`` rows, the later ones what is left, possibly
            none); the rows a replica needs move to its worker, only those.
        ``"balanced"`` (the default for Dask collections)
            every replica reads one run of rows: its worker's partitions,
            plus a slice of a neighbour's where it is short. Steps and
            per-replica batch sizes are those of ``"global"``, a step's rows
            are not; only what balancing needs moves.
        ``"local"``
            prefer locality over balance: every replica reads the partitions
            its worker holds and nothing moves; replicas that run out first
            get empty batches until all have (TF's partial-batch rule).
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 2
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    experimental_split: str | None = None

    def __post_init__(self) -> None:
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError("experimental_per_replica_buffer_size must be >= 0")
        if isinstance(self.auto_shard_policy, str):
            object.__setattr__(self, "auto_shard_policy", AutoShardPolicy[self.auto_shard_policy.upper()])
        if self.experimental_split not in (None, "global", "balanced", "local"):
            raise ValueError(
                f"experimental_split must be 'global', 'balanced', 'local' or None (chosen by the source), "
                f"got {self.experimental_split!r}"
            )


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
