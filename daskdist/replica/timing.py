"""Per-step phase timings of one replica: input wait, compute, all-reduce, apply.

The runtime opens a step around each function it runs; collectives, input
iterators and variable updates add their time to the open step. Compute is
what remains. The last ``daskdist.metrics.history`` steps are kept, each
with its ``spans`` (input waits and collectives, for ``strategy.timeline``),
its ``collective_times`` (each collective's identity and duration, shipped
to the scheduler, where the replicas' records of one collective are aligned
to find the replica the others waited for) and its ``samples`` (rows of the
batch it processed, ``None`` where the replica cannot know).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["MAX_SPANS", "StepTimer", "StepTiming"]

MAX_SPANS = 256  # spans (and collective times) kept per step; a step with more keeps its first ones (the totals stay exact)


@dataclass
class StepTiming:
    """Where one replica's time went during one step (seconds).

    ``collective_times`` holds ``[run_id, seq, kind, seconds]`` per collective:
    ``(run_id, seq)`` is the collective's identity in its group (the same on
    every replica), ``seconds`` how long this replica spent in it.
    ``samples`` is the number of examples the replica processed in the step,
    or ``None`` when unknown (a function that takes no distributed batch).
    """

    run_id: int
    replica: int
    start: float
    total: float
    input_wait: float
    compute: float
    allreduce: float
    apply: float
    collectives: int
    nbytes: int
    samples: int | None = None
    collective_times: list[list[Any]] = field(default_factory=list)
    # [name, offset from start (s), duration (s), nbytes]: "input", "apply" or a collective's kind
    spans: list[list[Any]] = field(default_factory=list)

    def to_dict(self, spans: bool = True) -> dict[str, Any]:
        """The fields as a plain dict (``spans`` copied only when asked: the hot path ships without them)."""
        out = {name: getattr(self, name) for name in _SHIPPED_FIELDS}
        if spans:
            out["spans"] = [list(span) for span in self.spans]
        return out


_SHIPPED_FIELDS = tuple(f.name for f in fields(StepTiming) if f.name != "spans")


class StepTimer:
    """Accumulates the phases of the current step and keeps a bounded history."""

    def __init__(self, replica: int, history: int):
        self.replica = replica
        self.history: collections.deque[StepTiming] = collections.deque(maxlen=history)
        self._open = False
        self._pending_input = 0.0  # input produced between steps (client-driven iterators), charged to the next
        self._reset(0)

    def _reset(self, run_id: int) -> None:
        self._run_id = run_id
        self._wall_start = time.time()
        self._start = time.perf_counter()
        self._input = self._allreduce = self._apply = 0.0
        self._charged_input = 0.0
        self._collectives = 0
        self._nbytes = 0
        self._samples: int | None = None
        self._collective_times: list[list[Any]] = []
        self._spans: list[list[Any]] = []

    def begin(self, run_id: int) -> None:
        self._reset(run_id)
        self._input, self._pending_input = self._pending_input, 0.0
        self._charged_input = self._input
        if self._input:
            self._spans.append(["input", -self._input, self._input, 0])
        self._open = True

    def _span(self, name: str, seconds: float, nbytes: int = 0) -> None:
        """Record a span that ends now."""
        if len(self._spans) < MAX_SPANS:
            self._spans.append([name, time.perf_counter() - self._start - seconds, seconds, nbytes])

    def add_pending_input(self, seconds: float) -> None:
        """Input prepared outside a step (``next`` from the client); counted in the next step."""
        self._pending_input += seconds

    def add_collective(self, kind: str, seconds: float, nbytes: int, key: tuple[int, int] | None = None) -> None:
        """A collective of the open step took ``seconds``; ``key`` is its ``(run_id, seq)`` in the group."""
        if self._open:
            self._allreduce += seconds
            self._collectives += 1
            self._nbytes += nbytes
            self._span(kind, seconds, nbytes)
            if key is not None and len(self._collective_times) < MAX_SPANS:
                self._collective_times.append([int(key[0]), int(key[1]), kind, seconds])

    def add_input_wait(self, seconds: float) -> None:
        if self._open:
            self._input += seconds
            self._span("input", seconds)

    def add_apply(self, seconds: float) -> None:
        if self._open:
            self._apply += seconds
            self._span("apply", seconds)

    def add_samples(self, samples: int) -> None:
        """The open step processed ``samples`` more examples (rows of this replica's batch)."""
        if self._open:
            self._samples = (self._samples or 0) + int(samples)

    def end(self, samples: int | None = None) -> StepTiming:
        """Close the step; ``samples`` counts when the step itself reported none (``add_samples``)."""
        total = time.perf_counter() - self._start + self._charged_input  # input made before the step counts too
        self._open = False
        compute = max(0.0, total - self._input - self._allreduce - self._apply)
        timing = StepTiming(
            run_id=self._run_id,
            replica=self.replica,
            start=self._wall_start,
            total=total,
            input_wait=self._input,
            compute=compute,
            allreduce=self._allreduce,
            apply=self._apply,
            collectives=self._collectives,
            nbytes=self._nbytes,
            samples=self._samples if self._samples is not None else samples,
            collective_times=self._collective_times,
            spans=self._spans,
        )
        self.history.append(timing)
        return timing
