"""Checks shared by the transport tests: the routes a group took, an all-reduce of every op against numpy."""

from __future__ import annotations

import dask
import numpy as np

import daskdist as dd


def group_routes(client, strategy):
    """Each replica's route to each peer (``{rank: {peer: name}}``) in ``strategy``'s group."""
    token = strategy.extended.group.group_id

    def describe(dask_worker):
        out = {}
        for group, runtime in dask_worker.extensions["daskdist"].replicas.items():
            if group == token:
                transport = runtime.transport
                out[runtime.rank] = transport.describe() if hasattr(transport, "describe") else transport.name
        return out

    merged = {}
    for part in client.run(describe).values():
        merged.update(part)
    return merged


#: How far an all-reduce may be from numpy's, per dtype: a few units in the last place of the type (the sums
#: run in another order), so a float64 path reduced at a lower precision fails.
TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2, "float32": 2e-6, "float64": 1e-12}

#: Each collective's deadline in ``check_all_reduce`` (a few seconds in all on a quiet machine): a message that
#: never arrives fails the test with the collective's own timeout error, naming the replicas it waited for,
#: well within pytest-timeout's 120 s (the default ``collective.timeout``, 300 s, is not).
COLLECTIVE_TIMEOUT = "45s"


def check_all_reduce(strategy, seed):
    """Every op, several dtypes and odd sizes, against numpy (each replica can rebuild all inputs)."""

    def fn():
        ctx = dd.get_replica_context()
        n, rank = ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
        failures = []
        cases = [
            ("SUM", "float32", (1001,)), ("SUM", "float64", ()), ("SUM", "int32", (0,)),
            ("MEAN", "float16", (7, 3)), ("MAX", "int8", (13,)), ("MIN", "uint8", (5,)),
            ("PRODUCT", "int64", (3,)), ("SUM", "bool", (9,)), ("SUM", "float32", (700_001,)),
            ("MEAN", "float64", (300_000,)), ("SUM", "bfloat16", (11,)),
        ]
        for op, dtype, shape in cases:
            inputs = []
            if dtype == "bfloat16":
                import ml_dtypes

                dtype = ml_dtypes.bfloat16
            for r in range(n):
                rng = np.random.default_rng([seed, r, len(shape)])
                if dtype == "bool":
                    inputs.append(rng.random(shape) > 0.5)
                elif np.dtype(dtype).kind in "iuV":
                    inputs.append(rng.integers(0, 4, shape).astype(dtype))
                else:
                    inputs.append(rng.standard_normal(shape).astype(dtype))
            got = ctx.all_reduce(op, inputs[rank])
            stacked = np.stack(inputs)
            if op in ("SUM", "MEAN"):
                want = stacked.any(axis=0) if dtype == "bool" else stacked.sum(axis=0, dtype=dtype)
                if op == "MEAN":
                    want = (want / n).astype(dtype)
            else:
                want = {"MAX": np.max, "MIN": np.min, "PRODUCT": np.prod}[op](stacked, axis=0).astype(dtype)
            tolerance = TOLERANCE.get(np.dtype(dtype).name, 0.0)  # integers and booleans: exact
            if got.shape != want.shape or got.dtype != np.dtype(dtype) or not np.allclose(
                got.astype("float64"), want.astype("float64"), rtol=tolerance, atol=tolerance
            ):
                failures.append((op, dtype, shape))
        scattered = ctx.reduce_scatter("SUM", np.arange(10.0) * (rank + 1), axis=0)
        if scattered.tolist() != np.array_split(np.arange(10.0) * n * (n + 1) / 2, n)[rank].tolist():
            failures.append("reduce_scatter")
        if ctx.broadcast({"w": np.full(3, rank)}, root=n - 1)["w"].tolist() != [n - 1] * 3:
            failures.append("broadcast")
        ctx.barrier()
        gathered = ctx.all_gather(np.full((rank + 1, 2), rank), axis=0)
        if gathered[:, 0].tolist() != [r for r in range(n) for _ in range(r + 1)]:
            failures.append("all_gather")
        return failures

    with dask.config.set({"daskdist.collective.timeout": COLLECTIVE_TIMEOUT}):  # sent with the command
        out = strategy.run(fn)
    assert all(f == [] for f in strategy.experimental_local_results(out)), strategy.experimental_local_results(out)


#: The config that sends a group's small all-reduces down each lane: the shared-memory lane on one host, the
#: socket lane when every worker is its own host (every peer reached over TCP).
LANES = {
    "shm": {"daskdist.collective.transport": "shm"},
    "socket": {"daskdist.collective.transport": "auto", "daskdist.collective.hosts": "per-worker"},
}
_LANE_ATTRIBUTE = {"shm": "lane", "socket": "socket_lane"}


def lane_plans(strategy, client, lane: str = "shm", *, usable: bool = True) -> list[int]:
    """How many plans each replica's ``lane`` holds (``usable``: only those that take the lane, not the cached
    ``None`` of a signature that goes the general way); -1 where the replica has no such lane."""
    token = strategy.extended.group.group_id
    attribute = _LANE_ATTRIBUTE[lane]

    def count(dask_worker):
        out = []
        for group, runtime in dask_worker.extensions["daskdist"].replicas.items():
            if group == token:
                found = getattr(runtime.communicator, attribute, None)
                plans = [] if found is None else list(found._plans.values())
                out.append(-1 if found is None else sum(p is not None or not usable for p in plans))
        return out

    return [n for part in client.run(count).values() for n in part]
