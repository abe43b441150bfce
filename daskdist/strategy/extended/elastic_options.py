"""``ElasticOptions``: how an elastic strategy survives losing workers (opt-in).

A value the strategies take (``MirroredStrategy(elastic=...)``); it lives
beside them, below ``daskdist.elastic``, which carries the options out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dask.utils import parse_timedelta

__all__ = ["ElasticOptions"]

Duration = str | float | int
KEEPS = ("global_batch", "per_replica")


@dataclass(frozen=True)
class ElasticOptions:
    """Opt a strategy into elastic training: a lost worker no longer ends ``fit``.

    Pass it as ``dd.MirroredStrategy(..., elastic=dd.ElasticOptions(min_replicas=2))``.
    Without it a lost worker raises ``ReplicaLostError`` everywhere, as before.

    Parameters
    ----------
    min_replicas
        The fewest replicas training may continue on. Below it the strategy
        waits up to ``wait_timeout`` for the group to come back to this size
        (new Dask workers are admitted at that point), then raises
        ``ReplicaLostError`` naming the workers lost.
    max_replicas
        The most replicas the group may grow to (``None``: no bound).
    commit_every
        ``fit`` commits (keeps an in-memory copy of the model, the optimizer
        slots, the step and epoch counters and the epoch's running loss and
        metric totals on every replica) every this many steps, and at the end
        of each epoch. After a loss the survivors go back to the newest
        commit they all hold and replay the steps after it.
    max_failures
        How many losses one strategy survives; ``-1``: any number. The next
        loss raises ``ReplicaLostError``.
    wait_timeout
        How long to wait for enough workers when fewer than ``min_replicas``
        remain (a Dask duration: ``"10min"``, ``"30s"``, or seconds).
    generation_timeout
        How long the client waits for the scheduler to announce the group's
        new membership after a loss (a Dask duration).
    admit_every
        During ``fit``, how often replica 0 looks for free Dask workers (a
        Dask duration; ``None``: only at epoch boundaries). When it finds
        some and the group is below ``max_replicas``, the epoch stops at the
        next commit, the workers are admitted with that commit, and the epoch
        goes on over all members. In an ``@dd.elastic.run`` loop,
        ``State.commit`` looks (on the client) as often, and the loop's
        function is called again over all members (``None``: it never grows).
    keep
        What stays constant when the replica count changes. ``"global_batch"``
        (default): the dataset's global batch, re-split over the new replica
        count, so every step's arithmetic is that of an uninterrupted run.
        ``"per_replica"``: each replica's batch (the global batch at the start
        of ``fit`` divided by the replica count then), so the global batch
        grows and shrinks with the group; rescale the learning rate in
        ``on_membership_change``.
    on_membership_change
        ``callable(old, new)`` called on the client with the replica counts
        before and after each membership change (a loss survived, workers
        admitted, members retired), before training goes on, in ``fit`` and in
        ``dd.elastic.run`` loops. ``fit``'s Keras callbacks that define
        ``on_membership_change(event)`` are called too, with the event.
    cooldown
        A worker lost during training (killed, crashed, declared lost for
        missing heartbeats) is not admitted again for this long after its
        loss (a Dask duration), so a worker that keeps failing does not keep
        sending the group back to its last commit; each of its losses counts
        against ``max_failures``, whose error names the workers that failed
        and how often. Workers are told apart by their Dask name (kept when a
        nanny restarts a worker), else their address.
    """

    min_replicas: int = 1
    max_replicas: int | None = None
    commit_every: int = 1
    max_failures: int = -1
    wait_timeout: Duration = "10min"
    generation_timeout: Duration = "30s"
    admit_every: Duration | None = "30s"
    keep: str = "global_batch"
    on_membership_change: Callable[[int, int], object] | None = None
    cooldown: Duration = "60s"

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"min_replicas must be a positive int, got {self.min_replicas!r}")
        if self.max_replicas is not None and (not isinstance(self.max_replicas, int)
                                              or self.max_replicas < self.min_replicas):
            raise ValueError(f"max_replicas must be None or an int >= min_replicas ({self.min_replicas}), "
                             f"got {self.max_replicas!r}")
        if not isinstance(self.commit_every, int) or self.commit_every < 1:
            raise ValueError(f"commit_every must be a positive int, got {self.commit_every!r}")
        if not isinstance(self.max_failures, int) or self.max_failures < -1:
            raise ValueError(f"max_failures must be -1 (no limit) or a count >= 0, got {self.max_failures!r}")
        if self.keep not in KEEPS:
            raise ValueError(f"keep must be one of {KEEPS}, got {self.keep!r}")
        if self.on_membership_change is not None and not callable(self.on_membership_change):
            raise TypeError(f"on_membership_change must be callable(old, new), got {self.on_membership_change!r}")
        for name in ("wait_timeout", "generation_timeout", "admit_every", "cooldown"):
            if name == "admit_every" and self.admit_every is None:
                continue
            try:
                seconds = _seconds(getattr(self, name))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{name} must be a duration such as '10min' or 30, got {getattr(self, name)!r}") from e
            if seconds is None or seconds < 0:
                raise ValueError(f"{name} must be a duration >= 0, got {getattr(self, name)!r}")

    @property
    def wait_seconds(self) -> float:
        return _seconds(self.wait_timeout)

    @property
    def admit_seconds(self) -> float | None:
        return None if self.admit_every is None else _seconds(self.admit_every)

    @property
    def cooldown_seconds(self) -> float:
        return _seconds(self.cooldown)

    @property
    def generation_seconds(self) -> float:
        return _seconds(self.generation_timeout)


def _seconds(value: Duration) -> float:
    """A Dask duration in seconds; ``"10min"`` is read as ten minutes (Dask's own units have no ``min``)."""
    if isinstance(value, str) and value.strip().endswith("min"):
        value = value.strip()[:-3] + "minutes"
    return float(parse_timedelta(value, default="seconds"))

