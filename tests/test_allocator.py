"""The replicas' allocator settings (``daskdist.replica.malloc``), on real clusters."""

from __future__ import annotations

import platform

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.replica import allocator

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


@pytest.fixture(scope="module")
def process_client():
    """Worker processes of this module alone: the control needs processes whose allocator nobody tuned
    (the session's shared ``process_client`` has run other modules' replicas, which tune it once)."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=40) as cluster, Client(cluster, set_as_default=False) as client:
        yield client


def test_set_once_per_process_when_replicas_start(threaded_client, monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_tuned", False)
    monkeypatch.setattr(allocator, "set_malloc_options", lambda **kwargs: calls.append(kwargs) or True)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        strategy.run(lambda: 0)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        strategy.run(lambda: 0)
    assert calls == [{}]  # the workers are threads of this process: one process, one call


@pytest.mark.parametrize("setting, expected", [(False, []), ({"trim-threshold": 1 << 20}, [{"trim_threshold": 1 << 20}])])
def test_follows_the_config_read_on_the_client(threaded_client, monkeypatch, setting, expected):
    calls = []
    monkeypatch.setattr(allocator, "_tuned", False)
    monkeypatch.setattr(allocator, "set_malloc_options", lambda **kwargs: calls.append(kwargs) or True)
    with dask.config.set({"daskdist.replica.malloc": setting}), dd.MirroredStrategy(
            devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        strategy.run(lambda: 0)
    assert calls == expected


@glibc
def test_set_malloc_options_checks_its_arguments():
    assert allocator.set_malloc_options() is True
    with pytest.raises(ValueError, match="C ints"):
        allocator.set_malloc_options(trim_threshold=1 << 40)
    with pytest.raises(ValueError, match="C ints"):
        allocator.set_malloc_options(top_pad=-1)


def _faults_per_step(steps):
    import resource

    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 512)).astype(np.float32)
    faults = []
    for _ in range(steps):  # a step's temporaries: a few MB allocated and freed, as a layer's forward/backward
        start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        x = rng.standard_normal((2048, 512)).astype(np.float32)
        h = np.maximum(x @ w, 0)
        g = (h @ w.T) * (x > 0)
        del x, h, g
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start)
    return float(np.median(faults[5:]))


@glibc
def test_a_numpy_step_keeps_its_memory_under_dasks_worker_environment(process_client):
    """Dask's nanny gives workers ``MALLOC_TRIM_THRESHOLD_=65536``, which stops glibc's mmap threshold from
    adapting: every temporary of a few MB is mapped and unmapped, thousands of page faults per step
    (2,300-2,800 here). The replicas' malloc options, set when they start, bring that to about none.
    The first strategy leaves the allocator alone (the control), the second sets it (once per process).
    """
    env = set(process_client.run(lambda: __import__("os").environ.get("MALLOC_TRIM_THRESHOLD_")).values())
    assert env == {"65536"}
    medians = {}
    for setting in (False, "auto"):
        with dask.config.set({"daskdist.replica.malloc": setting}), dd.MirroredStrategy(
                devices=["/cpu:0", "/cpu:1"], client=process_client) as strategy:
            medians[setting] = strategy.experimental_local_results(strategy.run(_faults_per_step, args=(25,)))
    assert min(medians[False]) > 500, medians
    assert max(medians["auto"]) < 50, medians
