"""``CentralStorageExtended``: SPMD replicas, every variable once in one parameter store."""

from __future__ import annotations

from typing import Any

from distributed import Client

from daskdist.cluster.devices import parse_device
from daskdist.cluster.identity import scheduler_workers
from daskdist.strategy.extended.parameter_holder import ParameterHolderExtended

__all__ = ["CentralStorageExtended"]


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


