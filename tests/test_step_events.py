"""Short runs show on the scheduler: step timings arrive within ``metrics.event-interval`` without a next step.

Real LocalClusters: steps run on real replicas, their timings travel as Dask
events on a timer of the workers' event loops, and the scheduler's
``/metrics`` and ``/daskdist`` page are fetched over HTTP.
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
from daskdist.dashboard.page import time_unit

INTERVAL = 1.0  # seconds: daskdist.metrics.event-interval in these tests


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _base(client) -> str:
    return client.dashboard_link.rsplit("/", 1)[0]


def _poll(predicate, timeout: float):
    """The first truthy value of ``predicate`` within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return None


def _steps_per_replica(client, token: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _, event in client.get_events("daskdist-steps"):
        if event.get("group") == token:
            counts[event["replica"]] = counts.get(event["replica"], 0) + len(event["steps"])
    return counts


def _page_rows(dask_scheduler) -> list[dict]:
    """Per open ``/daskdist`` session: the replica of each bar and the time axis (server side)."""
    from bokeh.server.tornado import BokehTornado

    out = []
    for app in dask_scheduler.http_application.applications:
        if isinstance(app, BokehTornado) and "/daskdist" in app.app_paths:
            for session in app.get_sessions("/daskdist"):
                source = session.document.get_model_by_name("daskdist-steps")
                plot = next(m for m in session.document.roots[0].references()
                            if type(m).__name__ == "figure" and "Step phases" in (m.title.text or ""))
                axis = plot.yaxis[0]
                out.append({"replicas": list(source.data["replica"]), "label": axis.axis_label,
                            "formatter": type(axis.formatter).__name__, "scale": axis.formatter.args.get("scale")})
    return out


def _twenty_all_reduces():
    ctx = dd.get_replica_context()
    for _ in range(20):
        ctx.all_reduce("SUM", np.ones(16))


@pytest.fixture(scope="module")
def process_cluster_client():
    """A cluster of two worker processes and a dashboard."""
    with (LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0",
                       silence_logs=logging.ERROR) as cluster,
          Client(cluster, set_as_default=False) as client):
        yield client


def test_three_steps_reach_events_metrics_and_page_without_a_further_step(process_cluster_client):
    client = process_cluster_client
    with dask.config.set({"daskdist.metrics.event-interval": f"{INTERVAL}s"}):
        strategy = dd.MirroredStrategy(client=client)
    try:
        _fetch(_base(client) + "/daskdist")  # the page is open before the steps, as in a notebook beside it
        token = strategy.extended.token
        for _ in range(3):
            strategy.run(_twenty_all_reduces)
        last_step = time.monotonic()
        arrived = _poll(lambda: (c := _steps_per_replica(client, token)) == {0: 3, 1: 3} and c, 10)
        waited = time.monotonic() - last_step
        assert arrived == {0: 3, 1: 3}, _steps_per_replica(client, token)
        assert waited < INTERVAL + 3  # the interval, plus a loaded machine's slack; not "at close"

        metrics = _fetch(_base(client) + "/metrics")
        for rank in (0, 1):
            assert f'daskdist_steps_total{{group="{token}",replica="{rank}"}} 3.0' in metrics
            assert f'daskdist_collectives_total{{group="{token}",replica="{rank}"}} 60.0' in metrics

        def page_shows_three_steps():
            sessions = client.run_on_scheduler(_page_rows)
            return next((s for s in sessions if sorted(s["replicas"]) == [0, 0, 0, 1, 1, 1]), None)

        page = _poll(page_shows_three_steps, 10)  # the page refreshes every 500 ms
        assert page is not None, client.run_on_scheduler(_page_rows)
        # the page scales by its slowest step of every replica shown (a step near 1 ms picks ms or us)
        unit, factor = time_unit(max(s["total"] for timings in strategy.step_timings() for s in timings))
        assert page["label"] == f"time per step ({unit})" and page["formatter"] == "CustomJSTickFormatter"
        assert page["scale"] == factor
        # the strategy is still open: nothing waited for its close
        ids = strategy.run(lambda: dd.get_replica_context().replica_id_in_sync_group)
        assert strategy.experimental_local_results(ids) == tuple(range(strategy.num_replicas_in_sync))
    finally:
        strategy.close()


def test_every_step_arrives_when_the_strategy_closes(process_cluster_client):
    client = process_cluster_client
    with dask.config.set({"daskdist.metrics.event-interval": "1h"}):
        strategy = dd.MirroredStrategy(client=client)
    token = strategy.extended.token
    for _ in range(5):
        strategy.run(_twenty_all_reduces)
    time.sleep(0.5)
    assert _steps_per_replica(client, token) == {}  # an hour's batch: nothing yet
    strategy.close()
    assert _poll(lambda: _steps_per_replica(client, token) == {0: 5, 1: 5}, 10), _steps_per_replica(client, token)


def test_steps_after_a_sent_batch_start_a_new_timer(process_cluster_client):
    client = process_cluster_client
    with dask.config.set({"daskdist.metrics.event-interval": f"{INTERVAL}s"}):
        strategy = dd.MirroredStrategy(client=client)
    try:
        token = strategy.extended.token
        strategy.run(_twenty_all_reduces)
        assert _poll(lambda: _steps_per_replica(client, token) == {0: 1, 1: 1}, 10)
        strategy.run(_twenty_all_reduces)
        strategy.run(_twenty_all_reduces)
        assert _poll(lambda: _steps_per_replica(client, token) == {0: 3, 1: 3}, 10), \
            _steps_per_replica(client, token)
        batches = [len(e["steps"]) for _, e in client.get_events("daskdist-steps") if e["group"] == token]
        assert sorted(batches) == [1, 1, 2, 2]  # the later two steps travelled together, per replica
    finally:
        strategy.close()


@pytest.mark.parametrize(("seconds", "unit", "factor"), [
    (2.5, "s", 1.0), (1.0, "s", 1.0), (0.0015, "ms", 1e3), (0.001, "ms", 1e3), (0.00042, "µs", 1e6), (0.0, "µs", 1e6),
])
def test_time_axes_read_in_the_unit_of_their_longest_step(seconds, unit, factor):
    assert time_unit(seconds) == (unit, factor)
