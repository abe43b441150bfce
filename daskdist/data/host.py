"""``DatasetHost``: what a distributed dataset needs of the strategy that distributes it.

The strategies' Extended objects implement it; ``daskdist.data`` sits below
the strategies and never imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["DatasetHost"]


class DatasetHost(Protocol):
    """The replicas a distributed dataset feeds, and the client that drives them."""

    @property
    def token(self) -> str:
        """The strategy's identity: a pickled dataset resolves to its replicas' shards by it."""

    @property
    def client(self) -> Client:
        """The ``distributed.Client`` the replicas are driven through (the planner asks it where partitions live)."""

    @property
    def worker_addresses(self) -> tuple[str, ...]:
        """The compute replicas' worker addresses, in replica order."""

    def run_on_replicas(self, command: Callable[..., Any], args: tuple[Any, ...] = (), *,
                        args_per_replica: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Run ``command(service, *args)`` on every compute replica; their results in replica order."""

    def register_distributed_dataset(self, dataset_id: str, dataset: Any) -> None:
        """Keep ``dataset`` findable by its id (``distributed_dataset``) while the strategy lives."""
