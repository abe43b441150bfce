"""``MirroredExtended``: the SPMD contract with TF's mirrored placement, a copy of every variable on every replica."""

from __future__ import annotations

import logging

from daskdist.cluster.devices import DeviceSpec
from daskdist.cluster.placement import Placement, WorkerInfo
from daskdist.strategy.extended.spmd import SpmdExtended

__all__ = ["MirroredExtended"]

logger = logging.getLogger(__name__)


class MirroredExtended(SpmdExtended):
    """``MirroredStrategy``'s implementation (TF's ``MirroredExtended``): variables mirrored on every replica.

    ``MultiWorkerMirroredExtended`` subclasses it with another worker
    selection (``_select_placements``), as TF's ``CollectiveAllReduceExtended``
    subclasses ``MirroredExtended``.
    """

    def _select_placements(self, workers: list[WorkerInfo], specs: list[DeviceSpec] | None,
                           embedded: bool) -> list[Placement]:
        placed = super()._select_placements(workers, specs, embedded)
        if specs is None and not embedded:
            return _one_host(placed, type(self.strategy).__name__)
        return placed


def _one_host(placed: list[Placement], strategy_name: str) -> list[Placement]:
    """TF's MirroredStrategy is one machine: without ``devices``, keep the first host's workers (and say so)."""
    hosts = list(dict.fromkeys(p.host for p in placed))
    if len(hosts) <= 1:
        return placed
    kept = [p for p in placed if p.host == hosts[0]]
    logger.warning(
        "%s uses one machine, as in TensorFlow: the %d worker(s) on host %s (the cluster spans %d hosts: %s). "
        "Use dd.MultiWorkerMirroredStrategy to train on every host, or pass devices=...",
        strategy_name, len(kept), hosts[0], len(hosts), ", ".join(hosts),
    )
    return [Placement(i, p.address, p.host, DeviceSpec(p.device.device_type, i)) for i, p in enumerate(kept)]


