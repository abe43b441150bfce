"""What ``daskdist.strategy`` uses of the parameter-server service: the one module of ``daskdist.ps`` it imports.

The import-linter contract "strategy reaches ps only through ps.client"
(``pyproject.toml``) holds the strategies to these names: the stores'
group and references, the stored variables' handle, the closures' worker
commands and the per-worker input planning. Everything else in
``daskdist.ps`` is the service's own business.
"""

from __future__ import annotations

from daskdist.ps.closures import (
    PerWorkerIterator,
    PerWorkerValues,
    WorkerResource,
    make_dataset,
    make_iterator,
    run_closure,
    run_recorded_closure,
)
from daskdist.ps.input import ClosureDataLedger, plan_by_locality
from daskdist.ps.members import StoreGroup
from daskdist.ps.refs import RoundCounter, StoreRef
from daskdist.ps.values import AggregatingVariable, dedupe_key

__all__ = [
    "AggregatingVariable",
    "ClosureDataLedger",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RoundCounter",
    "StoreGroup",
    "StoreRef",
    "WorkerResource",
    "dedupe_key",
    "make_dataset",
    "make_iterator",
    "plan_by_locality",
    "run_closure",
    "run_recorded_closure",
]
