"""Observability: the scheduler's metrics store, /metrics, the /daskdist page, timelines, stall warnings.

All on real LocalClusters: steps run on real replicas, their timings travel as
Dask events to the scheduler plugin, and pages are fetched over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import re
import subprocess
import sys
import threading
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


#: Set once a stall warning naming replica 1 was logged (the threaded replicas log in this process).
_STALL_WARNED = threading.Event()


class _Warned(logging.Handler):
    def emit(self, record):
        if "replica 1 has not joined" in record.getMessage():
            _STALL_WARNED.set()


def _late_until_warned() -> None:
    """Replica 1's delay: until the others warned about it (no sleep guessing when the threshold passes)."""
    _STALL_WARNED.wait(60)


def test_stall_warning_names_the_late_replica(threaded_client, caplog):
    _STALL_WARNED.clear()

    def step():
        ctx = dd.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            _late_until_warned()
        return ctx.all_reduce("SUM", np.ones(8))

    handler = _Warned(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with (dask.config.set({"daskdist.collective.stall-warning": "0.3s"}),
              dd.MirroredStrategy(client=threaded_client) as strategy, caplog.at_level(logging.WARNING)):
            token = strategy.extended.token
            strategy.run(step)
            events = _wait(lambda: _stall_events(threaded_client, token))
    finally:
        logging.getLogger().removeHandler(handler)
    assert _STALL_WARNED.is_set()
    assert {e["replica"] for e in events} <= {0, 2}
    # a warning names replica 1; once the first warning is logged replica 1 goes on, so the other waiting replica's
    # probe may find everyone joined (missing []), and a peer that did not answer the probe in time is named too
    assert any(1 in e["missing"] for e in events), events
    assert all(set(e["missing"]) <= {1, 2} and e["kind"] == "all_reduce" and e["waited"] >= 0.3 for e in events), events
    assert "replica 1 has not joined it" in events[0]["message"]
    assert any("replica 1 has not joined" in r.getMessage() for r in caplog.records)


def test_no_stall_warning_in_a_normal_run(threaded_client):
    # a collective every replica joined cancels its warning: none fires after the threshold has passed (the
    # threshold is far above a step's milliseconds, so a loaded machine does not make a real stall)
    with (dask.config.set({"daskdist.collective.stall-warning": "1s"}),
          dd.MirroredStrategy(client=threaded_client) as strategy):
        token = strategy.extended.token
        _train_steps(strategy, 5)
        time.sleep(2.0)  # twice the threshold: a warning that fires late is still seen
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


# -- samples/s ------------------------------------------------------------------------------


def _metric_values(client, token: str) -> dict[str, float]:
    """The daskdist lines of the scheduler's /metrics for group ``token``, by name and labels."""
    _, text = _fetch(_base(client) + "/metrics")
    lines = [line for line in text.splitlines() if line.startswith("daskdist_") and f'group="{token}"' in line]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


def _group_summary(dask_scheduler, group_id: str, last: int = 50) -> dict:
    """What the store, the page's sources and the straggler tracker say of one group."""
    group = dask_scheduler.extensions["daskdist"].store.groups.get(group_id)
    if group is None:
        return {}
    return {
        "steps": {rank: r.steps_total for rank, r in group.replicas.items()},
        "samples": {rank: [s.get("samples") for s in r.history] for rank, r in group.replicas.items()},
        "samples_total": {rank: r.samples_total for rank, r in group.replicas.items()},
        "steps_per_second": group.throughput(),
        "replica_steps_per_second": {rank: r.throughput() for rank, r in group.replicas.items()},
        "samples_per_second": group.samples_per_second(),
        "collectives": group.recent_collectives(last),
        "stragglers": {rank: (t.count, t.mean_wait) for rank, t in group.straggler_summary(last).items()},
        "size": group.size,
    }


def _page_models(dask_scheduler, names: tuple[str, ...]) -> dict | None:
    """The data (or text) of the named models of the newest /daskdist session, as its browser gets them."""
    from bokeh.server.tornado import BokehTornado

    for app in dask_scheduler.http_application.applications:
        if isinstance(app, BokehTornado) and "/daskdist" in app.app_paths:
            sessions = app.get_sessions("/daskdist")
            if sessions:
                doc = sessions[-1].document
                out = {}
                for name in names:
                    model = doc.get_model_by_name(name)
                    out[name] = getattr(model, "text", None) or {k: list(v) for k, v in model.data.items()}
                return out
    return None


def test_store_counts_samples_and_finds_the_straggler_of_each_collective():
    store = MetricsStore(history=100, straggler_min_wait=0.001)

    def step(rank: int, i: int, samples, waits: list[float]) -> dict:
        return {"run_id": i, "replica": rank, "start": 100.0 + i, "total": 0.5, "input_wait": 0.0, "compute": 0.3,
                "allreduce": sum(waits), "apply": 0.0, "collectives": len(waits), "nbytes": 8, "samples": samples,
                "collective_times": [[i, k + 1, "all_reduce", w] for k, w in enumerate(waits)]}

    # two collectives per step; replica 1 arrives last at the first (the others wait 40 ms for it),
    # at the second everyone arrives within 0.1 ms (balanced: nobody charged)
    durations = {0: [0.045, 0.002], 1: [0.005, 0.0021], 2: [0.030, 0.0022]}
    for rank in (0, 2):
        store.record("daskdist-steps", {"group": "g", "replica": rank, "size": 3,
                                        "steps": [step(rank, i, 16, durations[rank]) for i in range(5)]})
    assert store.groups["g"].recent_collectives() == []  # replica 1 has not reported yet: nothing attributed
    store.record("daskdist-steps", {"group": "g", "replica": 1, "size": 3,
                                    "steps": [step(1, i, 16, durations[1]) for i in range(5)]})
    group = store.groups["g"]
    collectives = group.recent_collectives()
    assert len(collectives) == 10 and not group.stragglers.pending
    first = [c for c in collectives if c["seq"] == 1]
    assert all(c["replica"] == 1 and c["wait"] == pytest.approx(0.040) for c in first)
    assert {rank: (t.count, round(t.mean_wait, 6)) for rank, t in group.straggler_summary().items()} == {1: (5, 0.04)}
    assert len(group.recent_collectives(last=2)) == 4  # the collectives of the last two steps
    assert group.stragglers.totals[1].count == 5 and group.stragglers.totals[1].wait == pytest.approx(0.2)
    # samples: 16 per replica per step; each replica steps at 5 / 4.5 per second
    assert group.replicas[0].samples_total == 80
    assert group.samples_per_second() == pytest.approx(3 * 16 * 5 / 4.5)
    # a group whose steps do not know their samples has no samples/s
    store.record("daskdist-steps", {"group": "h", "replica": 0, "size": 1,
                                    "steps": [step(0, i, None, []) for i in range(3)]})
    assert store.groups["h"].samples_per_second() is None and store.groups["h"].throughput() > 0


def test_fit_and_evaluate_steps_carry_their_batch_rows(threaded_client):
    from daskdist import keras

    x = np.random.default_rng(0).random((128, 4)).astype(np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64)
    with (dask.config.set({"daskdist.metrics.event-interval": "0s"}),
          dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy):
        token = strategy.extended.token
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(2, input_shape=(4,))])
            model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd")
        data = dd.data.Dataset.from_tensor_slices((x, y)).batch(32)
        model.fit(data, epochs=2, verbose=0)
        model.evaluate(data, verbose=0)
        # 2 epochs of 4 steps + 4 evaluation steps, each with 16 rows per replica
        summary = _wait(lambda: (s := threaded_client.run_on_scheduler(_group_summary, group_id=token))
                        and all(n >= 12 for n in s["steps"].values()) and len(s["steps"]) == 2 and s)
        values = _metric_values(threaded_client, token)
        _fetch(_base(threaded_client) + "/daskdist")
        page = threaded_client.run_on_scheduler(_page_models, names=("daskdist-summary", "daskdist-steps"))
    for rank in (0, 1):
        assert summary["samples"][rank] == [16] * 12
        assert summary["samples_total"][rank] == 12 * 16
        assert values[f'daskdist_samples_total{{group="{token}",replica="{rank}"}}'] == 12 * 16
    # samples/s is the steps/s of each replica times its 16 rows, summed over the 2 replicas
    rates = summary["replica_steps_per_second"]
    assert summary["samples_per_second"] == pytest.approx(16 * (rates[0] + rates[1]))
    assert summary["samples_per_second"] >= 2 * 16 * summary["steps_per_second"] > 0
    assert values[f'daskdist_throughput_samples_per_second{{group="{token}"}}'] > 0
    assert token in page["daskdist-summary"] and "samples/s</b>" in page["daskdist-summary"]
    assert "samples/s unknown" not in page["daskdist-summary"]
    assert set(page["daskdist-steps"]["samples"]) == {"16"}


def test_custom_loop_samples_from_the_distributed_batch_or_unknown(threaded_client, trained):
    # ``trained`` ran steps that take no batch: their samples stay unknown, and so does its samples/s
    token = trained.extended.token
    summary = threaded_client.run_on_scheduler(_group_summary, group_id=token)
    assert all(s is None for rank in range(3) for s in summary["samples"][rank])
    assert summary["samples_per_second"] is None
    assert f'daskdist_throughput_samples_per_second{{group="{token}"}}' not in _metric_values(threaded_client, token)

    x = np.arange(90 * 2, dtype=np.float32).reshape(90, 2)
    with (dask.config.set({"daskdist.metrics.event-interval": "0s"}),
          dd.MirroredStrategy(client=threaded_client) as strategy):
        token = strategy.extended.token
        dist = strategy.experimental_distribute_dataset(dd.data.Dataset.from_tensor_slices(x).batch(30))
        for batch in dist:  # 3 global batches of 30: 10 rows per replica
            strategy.run(lambda b: dd.get_replica_context().all_reduce("SUM", b.sum()), args=(batch,))
        summary = _wait(lambda: (s := threaded_client.run_on_scheduler(_group_summary, group_id=token))
                        and all(n >= 3 for n in s["steps"].values()) and len(s["steps"]) == 3 and s)
        values = _metric_values(threaded_client, token)
    assert all(summary["samples"][rank] == [10, 10, 10] for rank in range(3))
    assert summary["samples_per_second"] > 0
    assert values[f'daskdist_throughput_samples_per_second{{group="{token}"}}'] > 0
    assert all(values[f'daskdist_samples_total{{group="{token}",replica="{rank}"}}'] == 30 for rank in range(3))

    # every metric the Grafana dashboard queries is on /metrics for this group
    exprs = [t["expr"] for panel in json.loads((ROOT / "dashboards/daskdist.json").read_text())["panels"]
             for t in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"daskdist_[a-z_]+", expr)}
    exported = {key.split("{")[0] for key in values}
    assert {"daskdist_samples_total", "daskdist_throughput_samples_per_second", "daskdist_straggler_total"} <= queried
    assert queried <= exported, queried - exported


# -- stragglers --------------------------------------------------------------------------------


def test_stragglers_name_the_replica_that_sleeps_before_each_all_reduce(threaded_client):
    late = 1

    def step():
        ctx = dd.get_replica_context()
        if ctx.replica_id_in_sync_group == late:
            time.sleep(0.25)  # far above what load adds to the others' arrival, so it is the late one
        return ctx.all_reduce("SUM", np.ones(16))

    with (dask.config.set({"daskdist.metrics.event-interval": "0s"}),
          dd.MirroredStrategy(client=threaded_client) as strategy):
        token = strategy.extended.token
        for _ in range(10):
            strategy.run(step)
        summary = _wait(lambda: (s := threaded_client.run_on_scheduler(_group_summary, group_id=token))
                        and len(s["collectives"]) >= 10 and s)
        _fetch(_base(threaded_client) + "/daskdist")  # a page session, built from the store now
        page = threaded_client.run_on_scheduler(
            _page_models, names=("daskdist-stragglers", "daskdist-collectives", "daskdist-stragglers-title"))
        values = _metric_values(threaded_client, token)

    # the store: each step's all_reduce, attributed to the sleeping replica with a ~250 ms wait
    collectives = summary["collectives"]
    assert len(collectives) == 10 and all(c["kind"] == "all_reduce" for c in collectives)
    blamed = [c for c in collectives if c["replica"] == late]
    assert len(blamed) >= 8
    assert all(0.1 < c["wait"] < 10.0 for c in blamed)
    count, mean_wait = summary["stragglers"][late]
    assert count >= 8 and 0.1 < mean_wait < 10.0
    assert max(summary["stragglers"], key=lambda r: summary["stragglers"][r][0]) == late

    # the page's Bokeh data: the summary table and the per-collective rows
    table = page["daskdist-stragglers"]
    row = table["replica"].index(late)
    assert table["count"][row] >= 8 and table["count"][row] == max(table["count"])
    assert 100 < table["mean_wait_ms"][row] < 10_000
    rows = page["daskdist-collectives"]
    assert len(rows["replica"]) == 10 and rows["replica"].count(late) >= 8
    title = page["daskdist-stragglers-title"]
    assert "Stragglers (last 50 steps)" in title and f"10 collectives, {sum(table['count'])} in which" in title

    # /metrics
    assert values[f'daskdist_straggler_total{{group="{token}",replica="{late}"}}'] >= 8
    assert values[f'daskdist_straggler_wait_seconds_total{{group="{token}",replica="{late}"}}'] > 8 * 0.1
    assert all(values[f'daskdist_straggler_total{{group="{token}",replica="{r}"}}'] <= 2 for r in (0, 2))


# -- the scheduler's copy of the step events ------------------------------------------------


def _step_topic(dask_scheduler) -> tuple[int | None, int]:
    from daskdist.dashboard.event_log import topic_events

    events = topic_events(dask_scheduler, "daskdist-steps")
    return events.maxlen, len(events)


def test_scheduler_keeps_a_bounded_copy_of_the_step_events(threaded_client):
    bound = dask.config.get("daskdist.metrics.scheduler-event-log")
    with (dask.config.set({"daskdist.metrics.event-interval": "0s"}),
          dd.MirroredStrategy(client=threaded_client) as strategy):
        token = strategy.extended.token
        _train_steps(strategy, 2 * bound)  # one event per step and replica: 3 x 2 x bound events
        summary = _wait(lambda: (s := threaded_client.run_on_scheduler(_group_summary, group_id=token))
                        and all(n >= 2 * bound for n in s["steps"].values()) and s)
    maxlen, length = threaded_client.run_on_scheduler(_step_topic)
    events = threaded_client.get_events("daskdist-steps")
    assert maxlen == bound and length == len(events) == bound  # not distributed's 1000
    assert all(e["group"] == token for _, e in events)  # the newest ones
    assert all(n == 2 * bound for n in summary["steps"].values())  # while the store has every step


def test_step_events_hold_at_most_event_max_steps(threaded_client):
    with (dask.config.set({"daskdist.metrics.event-interval": "1h", "daskdist.metrics.event-max-steps": 4}),
          dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy):
        token = strategy.extended.token
        _train_steps(strategy, 10)
        sent = _wait(lambda: [e for _, e in threaded_client.get_events("daskdist-steps") if e["group"] == token])
    events = _wait(lambda: len(steps := [e for _, e in threaded_client.get_events("daskdist-steps")
                                         if e["group"] == token]) >= 6 and steps)
    assert len(sent) >= 2  # batches of 4 went before the hour was up
    assert sorted(len(e["steps"]) for e in events) == [2, 2, 4, 4, 4, 4]  # the rest at close


# -- dask-labextension without a preload ------------------------------------------------------


def test_runtime_install_lists_the_page_in_individual_plots_json(make_cluster):
    client = make_cluster(2, processes=False)
    base = _base(client)
    before = json.loads(_fetch(base + "/individual-plots.json")[1])
    assert "/individual-daskdist-steps" not in before.values()  # no preload ran
    with (dask.config.set({"daskdist.metrics.event-interval": "0s"}),
          dd.MirroredStrategy(client=client) as strategy):
        _train_steps(strategy, 2)
        token = strategy.extended.token
        _wait(lambda: (s := client.run_on_scheduler(_group_summary, group_id=token))
              and all(n >= 2 for n in s["steps"].values()) and len(s["steps"]) == 2)
        plots = json.loads(_fetch(base + "/individual-plots.json")[1])
        assert plots.get("Individual Daskdist Steps") == "/individual-daskdist-steps"
        assert set(before.items()) < set(plots.items())  # distributed's own plots are still listed
        status, body = _fetch(base + "/individual-daskdist-steps")
        assert status == 200 and "Bokeh" in body
        assert _fetch(base + "/daskdist")[0] == 200

        # the browser's side: a Bokeh client session over the page's websocket gets the replicas' steps.
        # In a subprocess with a deadline: a session that never completes (seen once on a loaded machine)
        # fails the test instead of hanging the suite.
        probe = (
            "import json, sys\n"
            "from bokeh.client import pull_session\n"
            "with pull_session(url=sys.argv[1]) as session:\n"
            "    data = session.document.get_model_by_name('daskdist-steps').data\n"
            "    print(json.dumps(sorted(int(r) for r in data['replica'])))\n"
        )
        done = subprocess.run([sys.executable, "-c", probe, base + "/daskdist"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        replicas = json.loads(done.stdout.strip().splitlines()[-1])
        assert sorted(set(replicas)) == [0, 1] and len(replicas) == 4
