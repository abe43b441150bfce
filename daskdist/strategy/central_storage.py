"""``CentralStorageStrategy``: synchronous training, each variable kept once in one process's host memory.

As in TensorFlow (``central_storage_strategy.py``), a short facade over the
parameter-server Extended with one parameter holder: compute is replicated
over the compute devices and runs every step in sync; variables are not
mirrored but stored once; each step the gradients are reduced to the
holder, the optimizer runs once there and the replicas read the new values.
"""

from __future__ import annotations

from distributed import Client

from daskdist.strategy.base import Strategy
from daskdist.strategy.extended.central_storage import CentralStorageExtended

__all__ = ["CentralStorageStrategy"]

class CentralStorageStrategy(Strategy):
    """Synchronous training with variables stored once, not mirrored (TF's ``experimental.CentralStorageStrategy``).

    Parameters
    ----------
    compute_devices
        The replicas' TF device strings, as ``MirroredStrategy``'s
        ``devices``; ``None``: every GPU worker, else every worker (the
        embedded cluster: every GPU, else one replica per core, at least 2).
    parameter_device
        Where the one copy of each variable lives: ``None`` or ``"/cpu:0"``
        for the host memory of replica 0's worker process (a store separate
        from that replica's compute copy), or a Dask worker address for that
        worker's memory.
    client
        The ``distributed.Client`` of an existing cluster; ``None`` as for
        ``MirroredStrategy``.

    Notes
    -----
    ``strategy.experimental_local_results(v)`` of a variable has one element
    and ``v.device`` is the parameter device. An ``assign`` in replica context
    is aggregated (the variable's ``aggregation``, which must not be ``NONE``
    with several replicas) and applied once; updates with a ``PerReplica``
    value raise, as in TensorFlow. ``fit`` sends each step's gradients to the
    parameter holder, which runs the optimizer once (one optimizer state, not
    one per replica); the losses equal ``MirroredStrategy``'s at the same
    global batch.

    Examples
    --------
    >>> strategy = dd.experimental.CentralStorageStrategy(client=client)   # doctest: +SKIP
    >>> with strategy.scope():
    ...     v = dd.Variable(np.zeros(3), aggregation="MEAN")
    >>> len(strategy.experimental_local_results(v))
    1
    """

    def __init__(self, compute_devices: list[str] | None = None, parameter_device: str | None = None, *,
                 client: Client | None = None):
        super().__init__(CentralStorageExtended(self, compute_devices, parameter_device, client))
