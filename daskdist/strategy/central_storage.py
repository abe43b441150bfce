"""``CentralStorageStrategy``: synchronous training, each variable kept once in one process's host memory.

As in TensorFlow (``central_storage_strategy.py``), a short facade over the
parameter-server Extended with one parameter holder: compute is replicated
over the compute devices and runs every step in sync; variables are not
mirrored but stored once; each step the gradients are reduced to the
holder, the optimizer runs once there and the replicas read the new values.
"""

from __future__ import annotations

from typing import Any

from distributed import Client

from daskdist.cluster.devices import parse_device
from daskdist.cluster.identity import scheduler_workers
from daskdist.strategy.base import Strategy
from daskdist.strategy.parameter_holder import ParameterHolderExtended

__all__ = ["CentralStorageExtended", "CentralStorageStrategy"]

_SCHEMES = ("tcp://", "tls://", "inproc://", "ucx://", "ws://", "wss://")


class CentralStorageExtended(ParameterHolderExtended):
    """``CentralStorageStrategy``'s implementation: SPMD replicas, one parameter store.

    Parameters
    ----------
    parameter_device
        ``None`` or a CPU device string (``"/cpu:0"``, ``"/device:CPU:0"``):
        the host memory of replica 0's worker process, in a store separate
        from replica 0's compute copies. A Dask worker address: that
        worker's memory (it need not run a replica, e.g. a CPU-only worker
        next to GPU workers).
    """

    def __init__(self, strategy: Any, compute_devices: list[str] | None, parameter_device: str | None,
                 client: Client | None):
        if compute_devices is not None and not isinstance(compute_devices, (list, tuple)):
            raise TypeError(f"compute_devices must be a list of device strings, got {type(compute_devices).__name__}")
        if parameter_device is not None and not isinstance(parameter_device, str):
            raise TypeError(f"parameter_device must be a device string or a Dask worker address, "
                            f"got {type(parameter_device).__name__}")
        device_name = None
        if parameter_device is not None and not parameter_device.startswith(_SCHEMES):
            device_name = _cpu_device_name(parameter_device)
        super().__init__(strategy, list(compute_devices) if compute_devices is not None else None, None, client)
        try:
            address, name = self._parameter_holder(parameter_device, device_name)
            self._open_stores([address], [name])
        except BaseException:
            self.close()
            raise

    def _parameter_holder(self, parameter_device: str | None, device_name: str | None) -> tuple[str, str]:
        """The worker holding the parameters and the device name variables report."""
        if parameter_device is not None and device_name is None:  # a worker address
            workers = scheduler_workers(self.client)
            if parameter_device not in workers:
                raise ValueError(f"parameter_device {parameter_device!r} is not a worker of this cluster; "
                                 f"workers: {sorted(workers)}")
            return parameter_device, parameter_device
        if device_name is None:  # TF: the only compute device, else the CPU
            device_name = self.worker_devices[0] if self.num_replicas == 1 else "/device:CPU:0"
        return self.worker_addresses[0], device_name


def _cpu_device_name(text: str) -> str:
    spec = parse_device(text)
    if spec.device_type != "CPU":
        raise ValueError(
            f"parameter_device {text!r}: parameters are held in a worker's host memory; give a CPU device "
            "('/cpu:0'), a Dask worker address, or None"
        )
    return spec.to_string()


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
