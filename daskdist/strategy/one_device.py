"""``OneDeviceStrategy``: the strategy API on a single replica."""

from __future__ import annotations

from distributed import Client

from daskdist.strategy.base import Strategy
from daskdist.strategy.extended.one_device import OneDeviceExtended

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """Everything on one device (TF's ``OneDeviceStrategy``): ``run`` returns plain values.

    Parameters
    ----------
    device
        One TF device string, such as ``"/cpu:0"`` or ``"/gpu:0"``.
    client
        An existing cluster's client; ``None`` as for ``MirroredStrategy``.
    """

    def __init__(self, device: str, *, client: Client | None = None):
        if not isinstance(device, str):
            raise TypeError(f"OneDeviceStrategy takes one device string, got {type(device).__name__}")
        super().__init__(OneDeviceExtended(self, device, client))
