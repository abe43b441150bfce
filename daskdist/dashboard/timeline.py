"""Chrome traces (``chrome://tracing``, Perfetto) of the replicas' steps.

Built from ``strategy.step_timings()``: per replica one process (``pid`` =
rank, one thread), a ``step`` event per step and, nested inside it, its input
waits, collectives (with their bytes), applies and the compute between them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["chrome_trace", "write_chrome_trace"]


def _event(name: str, cat: str, rank: int, start: float, duration: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": 0,
            "ts": round(start * 1e6, 3), "dur": round(max(duration, 0.0) * 1e6, 3), "args": args}


def _step_events(rank: int, step: dict[str, Any]) -> list[dict[str, Any]]:
    start, total = step["start"], step["total"]
    spans = sorted(step.get("spans", ()), key=lambda s: s[1])
    first = min([0.0, *(s[1] for s in spans)])  # input made before the step is charged to it
    events = [_event("step", "step", rank, start + first, total, {
        "run_id": step["run_id"], "collectives": step["collectives"], "nbytes": step["nbytes"],
        "input_wait": step["input_wait"], "compute": step["compute"], "allreduce": step["allreduce"],
        "apply": step["apply"], "samples": step.get("samples")})]
    cursor = first
    for name, offset, duration, nbytes in spans:
        if offset > cursor:
            events.append(_event("compute", "compute", rank, start + cursor, offset - cursor, {}))
        cat = name if name in ("input", "apply") else "collective"
        args = {"nbytes": nbytes} if cat == "collective" else {}
        events.append(_event(name, cat, rank, start + offset, duration, args))
        cursor = max(cursor, offset + duration)
    end = first + total
    if end > cursor:
        events.append(_event("compute", "compute", rank, start + cursor, end - cursor, {}))
    return events


def chrome_trace(timings: Sequence[Sequence[dict[str, Any]]], workers: Sequence[str] | None = None) -> dict[str, Any]:
    """A Chrome trace (``{"traceEvents": [...]}``) of per-replica step timings (rank order)."""
    events: list[dict[str, Any]] = []
    for rank, steps in enumerate(timings):
        where = f" on {workers[rank]}" if workers and rank < len(workers) else ""
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"replica {rank}{where}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for step in steps:
            events.extend(_step_events(rank, step))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str], timings: Sequence[Sequence[dict[str, Any]]],
                       workers: Sequence[str] | None = None) -> str:
    """Write ``chrome_trace(timings, workers)`` as JSON to ``path``; return the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(timings, workers), f)
    return os.fspath(path)
