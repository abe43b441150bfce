"""Named strategy combinations (TensorFlow's ``strategy_combinations`` in spirit): one test body, every facade.

Each ``Combination`` has a name (the test id), a factory that builds the strategy on a client, and the number
of replicas it runs. ``COMBINATIONS`` lists the six public strategies; ``ps`` is only where a behaviour means
something for parameter servers (scope and variables), ``default`` is the one-replica strategy outside any
scope, which needs no cluster.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers

TWO = ["/cpu:0", "/cpu:1"]


@dataclass(frozen=True)
class Combination:
    """A strategy to run a test body on: ``name``, ``make(client)`` and its ``replicas``."""

    name: str
    make: Callable = field(repr=False)
    replicas: int
    synchronous: bool = True  # replicas step together (run/reduce/gather, fit); not the parameter servers

    def __str__(self) -> str:
        return self.name

    @contextlib.contextmanager
    def strategy(self, client):
        """The strategy on ``client``, closed afterwards (the default strategy is never closed)."""
        strategy = self.make(client)
        if self.name == "default":
            yield strategy
            return
        with strategy:
            yield strategy


def _parameter_servers(client):
    info = scheduler_workers(client)
    ordered = sorted(info, key=lambda a: info[a]["name"])
    spec = dd.cluster_resolver.ClusterSpec({"ps": ordered[:1], "worker": ordered[1:]})
    return dd.ParameterServerStrategy(dd.cluster_resolver.SimpleClusterResolver(spec), client=client)


COMBINATIONS = [
    Combination("default", lambda client: dd.get_strategy(), 1),
    Combination("one_device", lambda client: dd.OneDeviceStrategy("/cpu:0", client=client), 1),
    Combination("mirrored_two_devices", lambda client: dd.MirroredStrategy(TWO, client=client), 2),
    Combination("mirrored_every_worker", lambda client: dd.MirroredStrategy(client=client), 3),
    Combination("multi_worker_mirrored", lambda client: dd.MultiWorkerMirroredStrategy(client=client), 3),
    Combination("central_storage", lambda client: dd.experimental.CentralStorageStrategy(TWO, client=client), 2),
    Combination("parameter_server", _parameter_servers, 2, synchronous=False),
]

#: the combinations whose replicas step together
SYNCHRONOUS = [c for c in COMBINATIONS if c.synchronous]
