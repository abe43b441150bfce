"""The value types ``Strategy`` methods take: ``RunOptions`` and ``ValueContext`` (TF's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RunOptions", "ValueContext"]


@dataclass(frozen=True)
class ValueContext:
    """Passed to ``experimental_distribute_values_from_function``'s function (TF's ``ValueContext``)."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


@dataclass(frozen=True)
class RunOptions:
    """Options for ``strategy.run`` (TF's ``tf.distribute.RunOptions``).

    TensorFlow's fields tune TPU compilation (dynamic batch sizes, XLA);
    there is no compilation here, so they are accepted and have no effect.
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None
