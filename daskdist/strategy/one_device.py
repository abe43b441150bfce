"""``OneDeviceStrategy``: the strategy API on a single replica."""

from __future__ import annotations

from typing import Any

from distributed import Client

from daskdist.ops import CommunicationOptions, ReduceOp
from daskdist.strategy.base import Strategy
from daskdist.strategy.spmd import SpmdExtended
from daskdist.variables import Variable

__all__ = ["OneDeviceExtended", "OneDeviceStrategy"]


class OneDeviceExtended(SpmdExtended):
    """``OneDeviceStrategy``'s implementation (TF's ``OneDeviceExtended``): one replica on one device.

    As in TF, ``reduce_to`` returns its value unchanged (there is nothing to
    combine) and ``read_var`` reads any variable.
    """

    def __init__(self, strategy: Any, device: str, client: Client | None):
        super().__init__(strategy, [device], None, client)

    def _reduce_to(self, op: ReduceOp, value: Any, destinations: Any, options: CommunicationOptions) -> Any:
        return value

    def read_var(self, v: Any) -> Any:
        self._require_cross_replica("extended.read_var")
        if not isinstance(v, Variable):
            raise ValueError(  # noqa: TRY004 - as MirroredExtended.read_var
                f"extended.read_var needs a variable, got {type(v).__name__}"
            )
        return v.read_value()


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
