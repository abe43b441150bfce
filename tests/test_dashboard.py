"""Observability: the scheduler's metrics store, /metrics, the /daskdist page, timelines, stall warnings.

All on real LocalClusters: steps run on real replicas, their timings travel as
Dask events to the scheduler plugin, and pages are fetched over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import time
import urllib.request

import dask
import numpy as np
import pytest

import daskdist as dd
from daskdist.dashboard.store import MetricsStore

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fetch(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def _base(client) -> str:
    return client.dashboard_link.rsplit("/", 1)[0]


def _wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _store_summary(dask_scheduler, group_id: str) -> dict:
    store = dask_scheduler.extensions["daskdist"].store
    group = store.groups.get(group_id)
    if group is None:
        return {}
    return {rank: {"steps": r.steps_total, "history": list(r.history), "rate": r.throughput(),
                   "bytes": r.bytes_total} for rank, r in group.replicas.items()}


def _train_steps(strategy, n: int) -> None:
    def step():
        ctx = dd.get_replica_context()
        time.sleep(0.002 * (ctx.replica_id_in_sync_group + 1))  # compute, longer on higher ranks
        return ctx.all_reduce("SUM", np.ones(4096))

    for _ in range(n):
        strategy.run(step)


@pytest.fixture(scope="module")
def trained(threaded_client):
    """A strategy that ran 6 steps, shipping each step's timing at once."""
    with dask.config.set({"daskdist.metrics.event-interval": "0s"}):
        strategy = dd.MirroredStrategy(client=threaded_client)
    try:
        _train_steps(strategy, 6)
        token = strategy.extended.token
        _wait(lambda: (s := threaded_client.run_on_scheduler(_store_summary, group_id=token))
              and all(r["steps"] >= 6 for r in s.values()) and len(s) == 3)
        yield strategy
    finally:
        strategy.close()


# -- the store --------------------------------------------------------------------------


def test_store_keeps_the_last_steps_throughput_and_progress():
    store = MetricsStore(history=3)
    steps = [{"run_id": i, "replica": 0, "start": 100.0 + i, "total": 0.5, "input_wait": 0.1, "compute": 0.2,
              "allreduce": 0.15, "apply": 0.05, "collectives": 2, "nbytes": 1000} for i in range(5)]
    store.record("daskdist-steps", {"group": "g", "replica": 0, "steps": steps})
    store.record("daskdist-progress", {"tag": "t", "epoch": 1, "step": 7, "logs": {"loss": 0.5}})
    store.record("unrelated", {"group": "x"})
    replica = store.groups["g"].replicas[0]
    assert [s["run_id"] for s in replica.history] == [2, 3, 4]
    assert replica.steps_total == 5 and replica.bytes_total == 5000 and replica.collectives_total == 10
    assert replica.throughput() == pytest.approx(3 / 2.5)
    assert replica.phases["allreduce"].count == 5 and replica.phases["allreduce"].total == pytest.approx(0.75)
    assert replica.phases["total"].cumulative()[-1] == ("+Inf", 5)
    assert store.latest_progress() == {"tag": "t", "epoch": 1, "step": 7, "logs": {"loss": 0.5},
                                       "time": store.progress["t"]["time"]}
    assert list(store.groups) == ["g"]


def test_scheduler_store_holds_each_replicas_steps(threaded_client, trained):
    summary = threaded_client.run_on_scheduler(_store_summary, group_id=trained.extended.token)
    assert sorted(summary) == [0, 1, 2]
    for rank, replica in summary.items():
        assert replica["steps"] == 6 and replica["bytes"] > 0 and replica["rate"] > 0
        assert all(s["replica"] == rank and s["allreduce"] > 0 and "spans" not in s for s in replica["history"])


# -- Prometheus -------------------------------------------------------------------------


def test_prometheus_metrics_on_the_dashboard(threaded_client, trained):
    pytest.importorskip("prometheus_client")
    token = trained.extended.token
    status, text = _fetch(_base(threaded_client) + "/metrics")
    assert status == 200
    lines = [line for line in text.splitlines() if line.startswith("daskdist_") and f'group="{token}"' in line]
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    for rank in range(3):
        assert values[f'daskdist_steps_total{{group="{token}",replica="{rank}"}}'] == 6
        assert values[f'daskdist_collectives_total{{group="{token}",replica="{rank}"}}'] == 6
        assert values[f'daskdist_collective_bytes_total{{group="{token}",replica="{rank}"}}'] >= 6 * 4096 * 8 / 3
        count = values[f'daskdist_step_phase_seconds_count{{group="{token}",phase="allreduce",replica="{rank}"}}']
        total = values[f'daskdist_step_phase_seconds_sum{{group="{token}",phase="allreduce",replica="{rank}"}}']
        assert count == 6 and 0 < total < 5
        compute = values[f'daskdist_step_phase_seconds_sum{{group="{token}",phase="compute",replica="{rank}"}}']
        assert compute >= 6 * 0.002 * (rank + 1) * 0.9
        inf = values[f'daskdist_step_phase_seconds_bucket{{group="{token}",le="+Inf",phase="total",replica="{rank}"}}']
        assert inf == 6
    assert values[f'daskdist_throughput_steps_per_second{{group="{token}"}}'] > 0


# -- the dashboard page -------------------------------------------------------------------


def _page_sources(dask_scheduler) -> list[dict]:
    """The data of every /daskdist session's step source (server side, as the browser would get it)."""
    from bokeh.server.tornado import BokehTornado

    out = []
    for app in dask_scheduler.http_application.applications:
        if isinstance(app, BokehTornado) and "/daskdist" in app.app_paths:
            for session in app.get_sessions("/daskdist"):
                source = session.document.get_model_by_name("daskdist-steps")
                summary = session.document.get_model_by_name("daskdist-summary")
                out.append({"data": {k: list(v) for k, v in source.data.items()}, "summary": summary.text})
    return out


def test_dashboard_page_shows_each_replicas_phases(threaded_client, trained):
    base = _base(threaded_client)
    status, body = _fetch(base + "/daskdist")
    assert status == 200 and "Bokeh" in body and "daskdist" in body
    status, status_page = _fetch(base + "/status")
    assert '<a href="daskdist">Daskdist</a>' in status_page  # the "More" menu
    status, individual = _fetch(base + "/individual-daskdist-steps")
    assert status == 200 and "Bokeh" in individual
    sessions = threaded_client.run_on_scheduler(_page_sources)
    assert sessions
    data = sessions[-1]["data"]
    assert trained.extended.token in sessions[-1]["summary"] and "steps/s" in sessions[-1]["summary"]
    for rank in range(3):
        rows = [i for i, r in enumerate(data["replica"]) if r == rank]
        assert len(rows) == 6
        assert all(data["allreduce"][i] > 0 and data["compute"][i] >= 0.002 * (rank + 1) * 0.9 for i in rows)
        assert all(abs(data["total"][i] - sum(data[p][i] for p in ("input_wait", "compute", "allreduce", "apply")))
                   < 1e-6 for i in rows)


def test_preload_adds_the_page_before_the_dashboard_starts():
    """``dask scheduler --preload dashboards/daskdist_preload.py``, with the scheduler in this process."""
    from distributed import Scheduler
    from distributed.dashboard import scheduler as dashboard
    from distributed.dashboard.scheduler import template_variables

    async def check() -> None:
        async with Scheduler(dashboard_address="127.0.0.1:0", port=0,
                             preload=[str(ROOT / "dashboards/daskdist_preload.py")]) as s:
            assert "daskdist" in s.plugins
            base = f"http://127.0.0.1:{s.http_server.port}"
            plots = json.loads((await asyncio.to_thread(_fetch, base + "/individual-plots.json"))[1])
            assert "/individual-daskdist-steps" in plots.values()
            assert (await asyncio.to_thread(_fetch, base + "/daskdist"))[0] == 200
            assert {"url": "daskdist", "name": "Daskdist"} in template_variables(s)["plots"]

    before = dict(dashboard.applications)
    try:
        asyncio.run(check())
    finally:  # the preload adds the pages to every scheduler of its process: undo that for the other tests
        dashboard.applications.clear()
        dashboard.applications.update(before)


# -- timeline -------------------------------------------------------------------------------


def test_timeline_writes_a_chrome_trace(trained, tmp_path):
    path = trained.timeline(tmp_path / "trace.json")
    trace = json.loads(pathlib.Path(path).read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(3):
        mine = [e for e in events if e["pid"] == rank]
        steps = [e for e in mine if e["name"] == "step"]
        collectives = [e for e in mine if e["cat"] == "collective"]
        compute = [e for e in mine if e["name"] == "compute"]
        assert len(steps) == 6 and len(collectives) == 6 and compute
        assert all(e["name"] == "all_reduce" and e["args"]["nbytes"] > 0 and e["dur"] > 0 for e in collectives)
        for step in steps:  # every phase lies inside its step
            inside = [e for e in mine if e is not step and step["ts"] <= e["ts"] + 1 and
                      e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1]
            assert {e["name"] for e in inside} >= {"all_reduce", "compute"}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(names) == 3


# -- stall warnings -------------------------------------------------------------------------


def _stall_events(client, token: str) -> list[dict]:
    return [e for _, e in client.get_events("daskdist-stall") if e.get("group") == token]


def test_stall_warning_names_the_late_replica(threaded_client, caplog):
    def step():
        ctx = dd.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            time.sleep(1.2)
        return ctx.all_reduce("SUM", np.ones(8))

    with (dask.config.set({"daskdist.collective.stall-warning": "0.3s"}),
          dd.MirroredStrategy(client=threaded_client) as strategy, caplog.at_level(logging.WARNING)):
        token = strategy.extended.token
        strategy.run(step)
        events = _wait(lambda: _stall_events(threaded_client, token))
    assert {e["replica"] for e in events} <= {0, 2}
    assert all(e["missing"] == [1] and e["kind"] == "all_reduce" and e["waited"] >= 0.3 for e in events)
    assert "replica 1 has not joined it" in events[0]["message"]
    assert any("replica 1 has not joined" in r.getMessage() for r in caplog.records)


def test_no_stall_warning_in_a_normal_run(threaded_client):
    with (dask.config.set({"daskdist.collective.stall-warning": "0.5s"}),
          dd.MirroredStrategy(client=threaded_client) as strategy):
        token = strategy.extended.token
        _train_steps(strategy, 5)
        time.sleep(0.6)
    assert _stall_events(threaded_client, token) == []


def test_fit_steps_reach_the_scheduler(threaded_client):
    """Steps run by fit (inside the replicas, not through strategy.run) are shipped too."""
    import daskdist as dd
    from daskdist import keras

    x = np.random.default_rng(0).random((128, 4)).astype(np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64)
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(2, input_shape=(4,))])
            model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd")
        model.fit(dd.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2, verbose=0)
        token = strategy.extended.token
    deadline = time.monotonic() + 10
    steps = []
    while time.monotonic() < deadline:
        events = [e for _, e in threaded_client.get_events("daskdist-steps") if e.get("group") == token]
        steps = [s for e in events for s in e["steps"]]
        if len(steps) >= 2 * 2 * 2:  # 2 epochs x 2 steps x 2 replicas
            break
        time.sleep(0.1)
    assert len(steps) >= 8
