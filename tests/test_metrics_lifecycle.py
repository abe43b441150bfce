"""A closed group's Prometheus series go (rates 0 at once, gone after the grace period), and
the dashboard page shows only live groups unless asked for closed ones.

The store and the collector directly, then a real LocalCluster whose /metrics and /daskdist are fetched over HTTP.
"""

from __future__ import annotations

import logging
import time
import urllib.request

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskdist as dd
from daskdist.dashboard.store import MetricsStore

pytest.importorskip("prometheus_client")


def _steps(n: int, start: float = 100.0) -> list[dict]:
    return [{"run_id": i, "replica": 0, "start": start + i, "total": 0.5, "input_wait": 0.1, "compute": 0.2,
             "allreduce": 0.15, "apply": 0.05, "collectives": 1, "nbytes": 10, "samples": 4} for i in range(n)]


def _collected(store: MetricsStore) -> dict[str, dict[tuple, float]]:
    """What the collector reports of ``store``'s groups: metric name -> labels -> value."""
    from daskdist.dashboard.prometheus import DaskdistCollector, register_store

    register_store(store)
    out: dict[str, dict[tuple, float]] = {}
    for family in DaskdistCollector().collect():
        for sample in family.samples:  # type: ignore[attr-defined]
            if sample.labels.get("group") in store.groups:
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_a_closed_group_reports_zero_rates_then_goes_after_the_grace_period():
    store = MetricsStore()
    for name in ("live", "done"):
        store.record("daskdist-steps", {"group": name, "replica": 0, "size": 1, "steps": _steps(5)})
    with dask.config.set({"daskdist.metrics.closed-grace": "1h"}):
        before = _collected(store)
        store.close_group("done")
        within = _collected(store)
    throughput = "daskdist_throughput_steps_per_second"
    assert before[throughput][(("group", "done"),)] > 0 and before[throughput][(("group", "live"),)] > 0
    assert within[throughput][(("group", "done"),)] == 0  # no throughput that does not exist
    assert within["daskdist_throughput_samples_per_second"][(("group", "done"),)] == 0
    assert within[throughput][(("group", "live"),)] > 0
    assert within["daskdist_steps_total"][(("group", "done"), ("replica", "0"))] == 5  # final counts, for a scrape

    with dask.config.set({"daskdist.metrics.closed-grace": "0s"}):
        after = _collected(store)
    assert all(dict(labels)["group"] == "live" for series in after.values() for labels in series)
    assert after["daskdist_steps_total"][(("group", "live"), ("replica", "0"))] == 5
    # within the grace period by the clock, gone after it
    closed_at = store.groups["done"].closed_at
    assert closed_at is not None
    assert [g.group for g in store.exported_groups(60, now=closed_at + 59)] == ["live", "done"]
    assert [g.group for g in store.exported_groups(60, now=closed_at + 61)] == ["live"]


def test_the_page_picks_the_latest_live_group_unless_closed_ones_are_asked_for():
    store = MetricsStore()
    store.record("daskdist-steps", {"group": "old", "replica": 0, "steps": _steps(2)})
    store.record("daskdist-steps", {"group": "new", "replica": 0, "steps": _steps(2)})
    assert store.latest_group().group == "new"
    store.close_group("new")
    assert store.latest_group().group == "old"
    assert store.latest_group(include_closed=True).group == "new"
    store.close_group("old")
    assert store.latest_group() is None


# -- on a real cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster, set_as_default=False) as client:
        yield client


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _metrics(client, token: str) -> dict[str, float]:
    text = _fetch(client.dashboard_link.rsplit("/", 1)[0] + "/metrics")
    lines = [line for line in text.splitlines() if line.startswith("daskdist_") and f'group="{token}"' in line]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


def _summary(dask_scheduler) -> str | None:
    """The summary text of the newest /daskdist session, as its browser gets it."""
    from bokeh.server.tornado import BokehTornado

    for app in dask_scheduler.http_application.applications:
        if isinstance(app, BokehTornado) and "/daskdist" in app.app_paths:
            sessions = app.get_sessions("/daskdist")
            if sessions:
                return sessions[-1].document.get_model_by_name("daskdist-summary").text
    return None


def _page(client) -> str:
    _fetch(client.dashboard_link.rsplit("/", 1)[0] + "/daskdist")
    return client.run_on_scheduler(_summary)


def _steps_reported(client, token: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        values = _metrics(client, token)
        if values and all(values.get(f'daskdist_steps_total{{group="{token}",replica="{r}"}}') == n for r in (0, 1)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the steps of {token} did not reach /metrics: {_metrics(client, token)}")


def test_metrics_and_page_of_a_closed_strategy_on_a_real_scheduler(client):
    with dask.config.set({"daskdist.metrics.event-interval": "0s", "daskdist.metrics.closed-grace": "1h"}):
        strategy = dd.MirroredStrategy(client=client)
        token = strategy.extended.token
        for _ in range(4):
            strategy.run(lambda: dd.get_replica_context().all_reduce("SUM", np.ones(8)))
        _steps_reported(client, token, 4)
        assert _metrics(client, token)[f'daskdist_throughput_steps_per_second{{group="{token}"}}'] > 0
        assert token in _page(client)
        strategy.close()

        values = _metrics(client, token)  # within the grace period: final counts, no throughput
        assert values[f'daskdist_throughput_steps_per_second{{group="{token}"}}'] == 0
        assert values[f'daskdist_steps_total{{group="{token}",replica="0"}}'] == 4
        page = _page(client)
        assert token not in page and "No live daskdist group" in page
        with dask.config.set({"daskdist.metrics.dashboard-closed-groups": True}):
            page = _page(client)
        assert token in page and "(closed)" in page

    with dask.config.set({"daskdist.metrics.closed-grace": "0s"}):
        assert _metrics(client, token) == {}  # after the grace period: every series of the group is gone
