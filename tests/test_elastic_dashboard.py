"""Membership changes are visible: the daskdist dashboard page, the Dask events, the logs and ``History``.

The end-to-end test kills a real ``dask worker`` process (and its nanny) during
an elastic ``fit`` and reads the page as a browser would (a Bokeh client
session over its websocket, in a subprocess with a deadline).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.request

import pytest

import daskdist as dd
from daskdist.dashboard.membership import marker_positions
from daskdist.dashboard.store import MetricsStore
from tests.support import models
from tests.support.killers import killed_at

Dataset = dd.data.Dataset

pytestmark = pytest.mark.timeout(240)

# What the page's membership sources hold, read through a Bokeh client session (as the browser gets them).
PROBE = """
import json, sys
from bokeh.client import pull_session
with pull_session(url=sys.argv[1]) as session:
    doc = session.document
    out = {name: {k: list(v) for k, v in doc.get_model_by_name(name).data.items()}
           for name in ("daskdist-membership", "daskdist-replicas", "daskdist-steps")}
    out["summary"] = doc.get_model_by_name("daskdist-summary").text
    print(json.dumps(out))
"""


def _steps_after(dask_scheduler, token: str, generation: int) -> int:
    """Rank 0's steps in the scheduler's store that started after ``generation`` began."""
    group = dask_scheduler.extensions["daskdist"].store.groups.get(token)
    if group is None or 0 not in group.replicas:
        return 0
    began = [c.time for c in group.membership.changes if c.generation == generation]
    if not began:
        return 0
    return sum(1 for step in group.replicas[0].history if step["start"] >= began[-1])


def _wait(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_the_store_marks_each_membership_change_before_the_first_step_of_its_generation():
    store = MetricsStore(history=10)
    store.membership_changed("s", 0, ["a", "b", "c"], [], "started")
    steps = [{"run_id": i, "replica": 0, "start": 100.0 + i, "total": 0.5, "input_wait": 0.0, "compute": 0.5,
              "allreduce": 0.0, "apply": 0.0, "collectives": 0, "nbytes": 0} for i in range(6)]
    for rank in range(3):
        store.record("daskdist-steps", {"group": "s", "replica": rank, "steps": steps[:3]})
    change = store.membership_changed("s", 1, ["a", "c"], ["a", "b", "c"], "b left")
    change.time = 102.5  # between steps 2 and 3
    for rank in range(2):
        store.record("daskdist-steps", {"group": "s", "replica": rank, "steps": steps[3:]})
    store.record("daskdist-elastic", {"strategy": "s", "generation": 1, "action": "restored", "commit": [1, 0, 2],
                                      "seconds": 1.5})
    group = store.groups["s"]
    assert sorted(group.steps()) == [0, 1]  # rank 2's history is of the old generation: not shown
    assert change.lost == ["b"] and change.admitted == []
    assert change.recovery == {"action": "restored", "commit": [1, 0, 2], "seconds": 1.5, "healed": None}
    assert change.label() == "gen 1: 2 replicas (lost 1, from step 2)"
    starts = [s["start"] for s in group.steps()[0]]
    ((x, marked),) = marker_positions(starts, group.membership.changes_after_start())
    assert marked is change and x == pytest.approx(2.95)  # in the gap before the 4th step, the first after it
    series = group.membership.series(now=200.0)
    assert series["replicas"] == [3, 2, 2] and series["generation"] == [0, 1, 1]
    assert series["time"][1:] == [102500.0, 200000.0] and series["lost"][1] == "b"
    # a change newer than every step goes at the right edge; one older than every step shown is left out
    assert marker_positions([100.0, 101.0], [change])[0][0] == pytest.approx(1.95)
    assert marker_positions([103.0, 104.0], [change]) == []
    # a group only registered does not take the page from the group whose steps came last
    store.membership_changed("other", 0, ["d"], [], "started")
    assert store.latest_group() is group
    # a strategy of several groups (the parameter-server strategy's one-replica worker groups): the count is theirs
    store.membership_changed("ps", 0, ["w1"], [], "started", "ps-worker-1")
    store.membership_changed("ps", 0, ["w2"], [], "started", "ps-worker-2")
    assert store.groups["ps"].membership.replicas == 2
    assert store.groups["ps"].membership.series(now=1e12)["replicas"] == [1, 2, 2]
    # a worker that retired gracefully left; it was not lost
    retired = store.membership_changed("s", 2, ["a"], ["a", "c"], "c retired", retired=["c"])
    assert retired.left == ["c"] and retired.lost == [] and retired.label() == "gen 2: 1 replicas (left 1)"


@pytest.mark.slow
def test_a_lost_worker_is_a_marker_on_the_step_chart_and_a_drop_in_the_replica_count(process_workers, caplog,
                                                                                     tmp_path):
    workers = process_workers(3)
    x, y = models.data(240)
    train = Dataset.from_tensor_slices((x, y)).batch(24)  # 10 steps per epoch
    strategy = dd.MirroredStrategy(client=workers.client, elastic=dd.ElasticOptions(min_replicas=2))
    with strategy:
        with strategy.scope():
            model = models.model()
        token = strategy.extended.token
        before = list(strategy.extended.worker_addresses)
        victim = before[1]
        started = time.time()
        with caplog.at_level(logging.INFO, logger="daskdist.elastic.recovery"), \
                killed_at(workers, tmp_path / "paused.json", "forward", step=4, rank=1) as killer:
            history = model.fit(train, epochs=2, verbose=0)
        assert killer.join()["address"] == victim

        # History and the client's daskdist-elastic event: time, generation, members before and after, reason
        (event,) = history.elastic_events
        assert event["generation"] == 1 and event["members_before"] == before and event["lost"] == [victim]
        assert event["members"] == [a for a in before if a != victim] and event["action"] == "restored"
        assert "ReplicaLostError" in event["reason"] and started < event["time"] < time.time()
        (logged,) = [m for _, m in workers.client.get_events("daskdist-elastic") if m.get("strategy") == token]
        assert json.loads(json.dumps({k: logged[k] for k in event})) == event  # msgpack gives tuples for lists
        # the scheduler's generation event names the members before and after, who was lost and why
        generations = [m for _, m in workers.client.get_events("daskdist")
                       if m.get("action") == "generation" and m.get("strategy") == token]
        assert [g["generation"] for g in generations] == [1]
        assert list(generations[0]["before"]) == before and list(generations[0]["lost"]) == [victim]
        assert generations[0]["replicas"] == 2 and victim in generations[0]["reason"] and generations[0]["time"] > 0
        # the client's log says it too
        lines = [r.getMessage() for r in caplog.records if r.name == "daskdist.elastic.recovery"]
        assert any("generation 1: 3 -> 2 members" in line and victim in line and "reason: ReplicaLostError" in line
                   for line in lines), lines

        # the page, once steps of the new generation reached the scheduler
        _wait(lambda: workers.client.run_on_scheduler(_steps_after, token=token, generation=1) >= 3)
        base = workers.client.dashboard_link.rsplit("/", 1)[0]
        with urllib.request.urlopen(base + "/daskdist", timeout=10) as response:
            assert response.status == 200
        done = subprocess.run([sys.executable, "-c", PROBE, base + "/daskdist"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        page = json.loads(done.stdout.strip().splitlines()[-1])

    markers, count, steps = page["daskdist-membership"], page["daskdist-replicas"], page["daskdist-steps"]
    assert markers["generation"] == [1] and markers["replicas"] == [2] and markers["lost"] == [victim]
    assert markers["label"][0].startswith("gen 1: 2 replicas (lost 1")
    rank0 = sum(1 for r in steps["replica"] if r == 0)
    assert 0 < markers["x"][0] < rank0  # between steps: some before the loss, some after
    assert sorted(set(steps["replica"])) == [0, 1]  # the ranks of the new generation
    assert count["replicas"] == [3, 2, 2] and count["generation"] == [0, 1, 1]
    assert count["time"][0] < count["time"][1] <= count["time"][2] and count["lost"][1] == victim
    assert started * 1000 < count["time"][1] < time.time() * 1000
    assert "generation 1: 1 worker(s) lost, 0 retired" in page["summary"]
