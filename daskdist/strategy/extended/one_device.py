"""``OneDeviceExtended``: the SPMD contract on one replica."""

from __future__ import annotations

from typing import Any

from distributed import Client

from daskdist.ops import CommunicationOptions, ReduceOp
from daskdist.strategy.extended.spmd import SpmdExtended
from daskdist.variables.distributed import Variable

__all__ = ["OneDeviceExtended"]


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


