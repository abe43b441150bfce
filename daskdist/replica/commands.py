"""What the client can ask a replica to do. Each command is ``command(service, *args)``.

The client pickles ``(command, args)``; the replica thread unpickles it (so
variable references resolve to the replica's copies) and calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from daskdist import context
from daskdist.group.service import VARIABLE
from daskdist.variables.distributed import VariableSpec, distributed_variable_class

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = [
    "create_variable",
    "ping",
    "read_variable",
    "run_function",
    "step_timings",
    "update_variable",
]


def run_function(service: ReplicaService, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a user function in replica context, timed as one step."""
    return service.run_step(fn, args, kwargs)


def create_variable(service: ReplicaService, var_id: str, value: Any, spec: VariableSpec) -> None:
    """Store this replica's copy of a variable created on the client under ``strategy.scope()``."""
    cls = distributed_variable_class(spec)
    service.objects.install(VARIABLE, var_id, cls(spec, service.token, var_id, local_value=value, runtime=service))


def read_variable(service: ReplicaService, var_id: str) -> Any:
    """This replica's value of a variable."""
    return service.objects.get(VARIABLE, var_id).value()


def update_variable(service: ReplicaService, var_id: str, method: str, value: Any) -> None:
    """Apply a client-side (cross-replica) ``assign`` / ``assign_add`` / ``assign_sub`` to this copy."""
    variable = service.objects.get(VARIABLE, var_id)
    frame = context.Frame(strategy=service.strategy_view, replica_context=None, variable_creator=None,
                          owner=service)
    with context.enter(frame):
        getattr(variable, method)(value)


def step_timings(service: ReplicaService, last: int | None = None) -> list[dict[str, Any]]:
    """The replica's most recent step timings, oldest first."""
    history = list(service.timer.history)
    if last is not None:
        history = history[-last:]
    return [t.to_dict() for t in history]


def ping(service: ReplicaService) -> int:
    """Return the replica's rank (used to measure the command round trip)."""
    return service.rank

