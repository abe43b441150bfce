"""One replica step loop: a loop over a replica's shard, opened, run some steps at a time, closed.

A loop of kind ``"train"`` or ``"test"`` reads one iterator over the
replica's shard. ``steps(count, step)`` runs up to ``count`` of its steps
(``None``: every remaining one): each batch is taken once its step's timer is
open (so the input wait counts), ``step(batch)`` runs it and returns its rows,
and the timer's step ends. Every replica runs the same steps (a replica whose
share of a global batch is empty still runs the step: it joins the exchange).
Commands run a whole epoch in one loop, or ``steps_per_execution`` steps at a
time between the client's per-batch callbacks (``training.commands``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from daskdist.training.timer import StepTimerLike

__all__ = ["ReplicaLoop"]


class ReplicaLoop:
    """One open loop over ``batches``.

    Parameters
    ----------
    batches
        The replica's shard (an iterable of batches).
    timer
        The replica's step timer (``begin(step)``, ``add_samples``, ``end()``), or ``None``.
    before_batch
        Called before each batch is taken (a test's fault point, ``fault_points.arm``), or ``None``.

    Attributes
    ----------
    done : int
        Steps run so far.
    """

    def __init__(self, batches: Iterable[Any], timer: StepTimerLike | None = None,
                 before_batch: Callable[[], None] | None = None):
        self._iterator = iter(batches)
        self.timer = timer
        self.before_batch = before_batch
        self.done = 0
        self.exhausted = False

    def steps(self, count: int | None, step: Callable[[Any], int],
              after_step: Callable[[int], None] | None = None) -> int:
        """Up to ``count`` steps (``None``: every remaining); the steps run.

        ``step(batch)`` runs one and returns its local rows; ``after_step(done)``
        is called after each with the loop's steps so far.
        """
        ran = 0
        timer = self.timer
        while count is None or ran < count:
            if timer is not None:
                timer.begin(self.done)
            if self.before_batch is not None:
                self.before_batch()
            try:
                batch = next(self._iterator)
            except StopIteration:
                self.exhausted = True
                break
            rows = step(batch)
            if timer is not None:
                timer.add_samples(rows)
                timer.end()
            self.done += 1
            ran += 1
            if after_step is not None:
                after_step(self.done)
        return ran

    def close(self) -> None:
        """Close the batch iterator (its input pipeline's resources go)."""
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()
