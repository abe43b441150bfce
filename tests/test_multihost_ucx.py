"""The ucx transport across real separate hosts (network namespaces, TCP underneath: veth has no RDMA).

Needs ``ucxx`` (the ``ucx`` extra; ``make test-ucx``) and namespace hosts
(root, iproute2); skipped otherwise. Select with ``-m netns``. The figures:
``benchmarks/multihost_allreduce.py --systems ucx``.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist import context
from daskdist.replica import commands

pytestmark = pytest.mark.netns

N = 1 << 20  # float64: 8 MiB


def _input(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(N)


def _reduce():
    ctx = dd.get_replica_context()
    x = _input(ctx.replica_id_in_sync_group)
    small = ctx.all_reduce("SUM", np.full(1024, float(ctx.replica_id_in_sync_group), np.float32))
    return {"large": ctx.all_reduce("SUM", x), "small": small,
            "routes": context.current_runtime().transport.describe()}


def test_ucx_across_namespace_hosts_gives_the_sum(netns_hosts):
    pytest.importorskip("ucxx")
    _, client = netns_hosts
    want = np.sum([_input(r) for r in range(4)], axis=0)
    with dask.config.set({"daskdist.collective.transport": "ucx"}), \
            dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        out = strategy.extended.group.call(commands.run_function, (_reduce, (), {}))
    assert [set(o["routes"].values()) for o in out] == [{"ucx"}] * 4
    for o in out:
        np.testing.assert_allclose(o["large"], want, rtol=1e-12, atol=1e-12)
        assert np.array_equal(o["large"], out[0]["large"])
        assert o["small"].tolist() == [6.0] * 1024
