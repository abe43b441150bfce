"""Commands the strategy contract sends to replicas (``command(service, *args)``).

The contract's own verbs that need code on the replica: installing a
resident object, and TF's ``extended.update`` applied to one variable copy.
It imports nothing of the strategy package: ``extended`` imports it (lazily),
never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from daskdist import context, fault_points

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService
    from daskdist.variables.distributed import DistributedVariable

__all__ = ["install_resident", "update_copy"]


def install_resident(service: ReplicaService, kind: str, object_id: str, obj: Any) -> None:
    """Keep ``obj`` on this replica under ``(kind, object_id)``, replacing an earlier one."""
    service.objects.install(kind, object_id, obj)
    fault_points.installed(service.rank)  # a test's fault point (``daskdist.testing.pause-at``): installed, unanswered


def update_copy(service: ReplicaService, variable: DistributedVariable, fn: Callable[..., Any],
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(copy, *args, **kwargs)`` on this replica's copy, in cross-replica context (TF's ``UpdateContext``).

    ``variable`` arrives as a reference and resolves to this replica's copy;
    ``assign`` and friends inside ``fn`` apply to it as given, without
    aggregation.
    """
    frame = context.Frame(strategy=service.strategy_view, replica_context=None, variable_creator=None,
                          owner=service)
    with context.enter(frame):
        return fn(variable, *args, **kwargs)
