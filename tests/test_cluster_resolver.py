"""Cluster resolvers and ClusterSpec, with TensorFlow's expected values.

Each test names the TensorFlow test its cases come from:
``tensorflow/python/training/server_lib_clusterspec_test.py`` (ClusterSpecTest),
``tensorflow/python/distribute/cluster_resolver/tfconfig_cluster_resolver_test.py``
(TFConfigClusterResolverTest) and ``.../cluster_resolver_test.py`` (SimpleClusterResolverTest).
The Dask resolver runs against a real ``LocalCluster``.
"""

from __future__ import annotations

import json
import time

import pytest

import daskdist as dd
from daskdist.cluster.identity import scheduler_workers
from daskdist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    DaskClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)
from daskdist.cluster_resolver.selection import WorkerRecord, select_hosts, split_address

PS_WORKER = {"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]}


def _tf_config(monkeypatch, config: dict | str) -> None:
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))


# -- ClusterSpec (server_lib_clusterspec_test.py) ---------------------------------------------


def test_cluster_spec_accessors_match_tf_test_cluster_spec_accessors():
    """ClusterSpecTest.testClusterSpecAccessors."""
    original = {"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
                "sparse": {0: "sparse0:2222", 3: "sparse3:2222"}}
    spec = ClusterSpec(original)
    assert spec.as_dict() == original
    assert spec.jobs == ["ps", "worker", "sparse"]
    assert spec.num_tasks("ps") == 2 and spec.num_tasks("worker") == 3 and spec.num_tasks("sparse") == 2
    with pytest.raises(ValueError, match="No such job in cluster: 'unknown'"):
        spec.num_tasks("unknown")
    assert spec.task_address("ps", 0) == "ps0:2222" and spec.task_address("sparse", 0) == "sparse0:2222"
    with pytest.raises(ValueError, match="No task with index 1 in job 'sparse'"):
        spec.task_address("sparse", 1)
    with pytest.raises(ValueError, match="No such job"):
        spec.task_address("unknown", 0)
    assert spec.task_indices("sparse") == [0, 3]
    assert spec.job_tasks("sparse") == ["sparse0:2222", None, None, "sparse3:2222"]


def test_cluster_spec_sparse_job_as_dict_is_a_dict_and_dense_one_a_list():
    """ClusterSpecTest.testSparseJob / testSparseJobAsDict (as_dict keeps sparse jobs as dicts)."""
    spec = ClusterSpec({"worker": {7: "a:1"}, "ps": ("p:1",)})
    assert spec.as_dict() == {"worker": {7: "a:1"}, "ps": ["p:1"]}
    assert spec.task_indices("worker") == [7] and spec.num_tasks("worker") == 1
    assert ClusterSpec({"w": {"1": "x:1"}}).task_address("w", 1) == "x:1"  # TF casts string keys with int()
    assert ClusterSpec({"empty": {}}).as_dict() == {"empty": {}}


def test_cluster_spec_equality_and_truth_match_tf_test_eq_and_ne():
    """ClusterSpecTest.testEq / testNe and __bool__ (an empty spec is false)."""
    a = ClusterSpec({"job": ["host:2222"]})
    assert a == ClusterSpec({"job": ["host:2222"]}) and a == {"job": {0: "host:2222"}}
    assert a != ClusterSpec({"job": ["host:2223"]}) and a != ClusterSpec({"job2": ["host:2222"]})
    assert a != ClusterSpec({"job": ["host:2222", "host:2223"]})
    assert not ClusterSpec({}) and bool(a)


def test_cluster_spec_copy_orders_jobs_as_tf_does_through_its_cluster_def():
    """ClusterSpecTest.testProtoDictDefEquivalences: a copy equals the original (jobs sorted, as TF's ClusterDef)."""
    spec = ClusterSpec({"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]})
    copy = ClusterSpec(spec)
    assert copy == spec and copy.jobs == ["ps", "worker"]
    assert repr(copy) == "ClusterSpec({'ps': ['p0:1'], 'worker': ['w0:1', 'w1:1']})"


def test_cluster_spec_refuses_what_tf_refuses():
    """ClusterSpec constructor TypeErrors (server_lib.py: _make_cluster_def and the type check)."""
    with pytest.raises(TypeError, match="must be a dictionary mapping"):
        ClusterSpec(["worker0:2222"])
    with pytest.raises(TypeError, match="The tasks for job 'worker' must be a list or a dictionary"):
        ClusterSpec({"worker": "worker0:2222"})
    with pytest.raises(TypeError, match="Task address 2222 must be bytes or unicode"):
        ClusterSpec({"worker": [2222]})
    with pytest.raises(TypeError, match="Job name 1 must be bytes or unicode"):
        ClusterSpec({1: ["a:1"]})


# -- SimpleClusterResolver (cluster_resolver_test.py) ----------------------------------------


def test_simple_cluster_resolver_returns_what_it_was_given():
    """SimpleClusterResolverTest.testSimpleOverrideMasterWithTaskIndexZero / testRpcLayerOverride."""
    spec = ClusterSpec(PS_WORKER)
    resolver = SimpleClusterResolver(spec, master="grpc://x:1", task_type="worker", task_id=1,
                                     num_accelerators={"GPU": 8}, rpc_layer="grpc")
    assert resolver.cluster_spec() is spec
    assert resolver.master() == "grpc://grpc://x:1"  # TF prepends the rpc layer to whatever master is
    assert resolver.master("worker", 2) == "grpc://worker2:2222"
    assert resolver.master("ps", 0, rpc_layer="test") == "test://ps0:2222"
    assert resolver.num_accelerators() == {"GPU": 8}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer, resolver.environment) == ("worker", 1, "grpc", "")
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "ps", 0, None
    assert (resolver.task_type, resolver.task_id, resolver.master()) == ("ps", 0, "grpc://x:1")
    assert SimpleClusterResolver(spec).num_accelerators() == {}
    with pytest.raises(TypeError, match="cluster_spec must be a `ClusterSpec`"):
        SimpleClusterResolver({"worker": ["a:1"]})
    with pytest.raises(TypeError, match="master must be a string"):
        SimpleClusterResolver(spec, master=1)


def test_cluster_resolver_is_abstract():
    with pytest.raises(TypeError):
        ClusterResolver()


# -- TFConfigClusterResolver (tfconfig_cluster_resolver_test.py) ----------------------------------


def test_tf_config_cluster_spec_read_matches_tf_test_normal_cluster_spec_read(monkeypatch):
    """TFConfigClusterResolverTest.testNormalClusterSpecRead."""
    _tf_config(monkeypatch, {"cluster": PS_WORKER, "task": {"type": "ps", "index": 0}})
    assert TFConfigClusterResolver().cluster_spec().as_dict() == PS_WORKER


def test_tf_config_master_rules_match_tf_tests(monkeypatch):
    """testAutomaticMasterRead, testSpecifiedTaskTypeAndIndexMasterRead, testSessionMasterRead, testRpcLayerRead."""
    _tf_config(monkeypatch, {"cluster": PS_WORKER, "task": {"type": "ps", "index": 0}})
    resolver = TFConfigClusterResolver()
    assert resolver.master() == "ps0:2222"
    assert resolver.master("worker", 1) == "worker1:2222"
    _tf_config(monkeypatch, {"cluster": PS_WORKER, "session_master": "sessionmaster:2222",
                             "task": {"type": "ps", "index": 0}})
    assert resolver.master() == "sessionmaster:2222"
    _tf_config(monkeypatch, {"cluster": PS_WORKER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 0}})
    assert resolver.master() == "grpc://ps0:2222"  # the same resolver rereads TF_CONFIG on every call
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc")  # testTaskTypeIndexRpcRead


def test_tf_config_overrides_match_tf_test_parameter_overrides(monkeypatch):
    """testParameterOverrides, testTaskTypeCastToString, testTaskIndexCastToInteger, testTaskIndexOverride."""
    _tf_config(monkeypatch, {"cluster": PS_WORKER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 1}})
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0)
    assert (resolver.master(), resolver.task_type, resolver.task_id) == ("grpc://ps0:2222", "ps", 0)
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "worker", 1, "test"
    assert (resolver.master(), resolver.task_type, resolver.task_id, resolver.rpc_layer) == (
        "test://worker1:2222", "worker", 1, "test")
    _tf_config(monkeypatch, {"cluster": {"123456": ["ps0:2222"], "worker": ["w:1"]},
                             "task": {"type": 123456, "index": "1"}})
    assert TFConfigClusterResolver().task_type == "123456" and TFConfigClusterResolver().task_id == 1
    assert TFConfigClusterResolver(task_id=1).task_id == 1


def test_tf_config_empty_and_one_task_clusters_have_an_empty_master(monkeypatch):
    """testZeroItemsInClusterSpecMasterRead, testOneItemInClusterSpecMasterRead."""
    _tf_config(monkeypatch, "{}")
    resolver = TFConfigClusterResolver()
    assert resolver.master() == "" and resolver.cluster_spec() == {} and not resolver.cluster_spec()
    assert resolver.task_type is None and resolver.task_id is None
    _tf_config(monkeypatch, {"cluster": {"worker": ["worker0:2222"]}})
    assert resolver.master() == ""
    monkeypatch.delenv("TF_CONFIG")
    assert resolver.cluster_spec() == {} and resolver.rpc_layer is None


def test_malformed_tf_config_names_the_variable_and_the_json_error(monkeypatch):
    _tf_config(monkeypatch, '{"cluster": {"worker": ["a:1"]')
    with pytest.raises(ValueError, match=r"TF_CONFIG environment variable is not valid JSON: Expecting"):
        TFConfigClusterResolver().cluster_spec()
    _tf_config(monkeypatch, '["a:1"]')
    with pytest.raises(ValueError, match="TF_CONFIG environment variable must hold a JSON object"):
        _ = TFConfigClusterResolver().task_type


# -- selecting Dask workers with a spec -------------------------------------------------------------------

WORKERS = [WorkerRecord("tcp://10.0.0.1:4001", "a0", "h1"), WorkerRecord("tcp://10.0.0.1:4002", "a1", "h1"),
           WorkerRecord("tcp://10.0.0.2:4001", "b0", "h2"), WorkerRecord("tcp://10.0.0.2:4002", "b1", "h2")]


def test_a_spec_entry_selects_the_exact_worker_else_every_worker_on_its_host_in_spec_order():
    groups = select_hosts(ClusterSpec({"chief": ["h2:2222"], "worker": ["10.0.0.1:4002", "10.0.0.1:4001"]}), WORKERS)
    assert [(g.entry, g.workers) for g in groups] == [
        ("h2:2222", ("tcp://10.0.0.2:4001", "tcp://10.0.0.2:4002")),
        ("10.0.0.1:4002", ("tcp://10.0.0.1:4002",)),
        ("10.0.0.1:4001", ("tcp://10.0.0.1:4001",)),
    ]
    assert split_address("tcp://[::1]:80") == ("::1", "80") and split_address("h1") == ("h1", None)


def test_a_spec_entry_matching_no_worker_names_it_and_the_workers_that_exist():
    with pytest.raises(ValueError, match=r"entry 'h3:2222' matches no Dask worker; the Dask workers are: "
                                         r"tcp://10.0.0.1:4001 \(host h1\)"):
        select_hosts(ClusterSpec({"worker": ["h1:2222", "h3:2222"]}), WORKERS)
    with pytest.raises(ValueError, match="does not use parameter servers"):
        select_hosts(ClusterSpec({"worker": ["h1"], "ps": ["h2"]}), WORKERS)
    with pytest.raises(ValueError, match="both name the Dask worker"):
        select_hosts(ClusterSpec({"worker": ["h1", "10.0.0.1:4001"]}), WORKERS)
    with pytest.raises(ValueError, match="no 'chief' or 'worker' task"):
        select_hosts(ClusterSpec({"evaluator": ["h1"]}), WORKERS)


# -- DaskClusterResolver on a real cluster ----------------------------------------------------------------


def test_dask_cluster_resolver_reads_the_live_cluster_on_every_call():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        resolver = dd.cluster_resolver.DaskClusterResolver(client)
        host = resolver.cluster_spec().task_address("worker", 0)
        assert resolver.cluster_spec().as_dict() == {"worker": [host]}  # both workers in one process: one host
        assert (resolver.task_type, resolver.task_id) == (None, None)
        assert resolver.master() == cluster.scheduler_address and resolver.rpc_layer == "inproc"
        assert resolver.master("worker", 0) == f"inproc://{host}"
        assert resolver.num_accelerators() == {} and resolver.environment == ""
        assert [len(h.workers) for h in resolver.hosts()] == [2]
        one = DaskClusterResolver(client, workers=[next(iter(scheduler_workers(client)))])
        assert len(one.hosts()[0].workers) == 1
        cluster.scale(0)
        for _ in range(100):
            if not scheduler_workers(client):
                break
            time.sleep(0.05)
        assert resolver.cluster_spec() == {} and not resolver.cluster_spec()  # live, nothing cached
    with pytest.raises(TypeError, match="client must be a distributed.Client"):
        DaskClusterResolver("tcp://x:1")


# -- DaskClusterResolver(num_ps=k): roles for ParameterServerStrategy --------------------------------------

from daskdist.cluster_resolver.selection import choose_ps, select_ps_roles  # noqa: E402


def test_num_ps_spreads_the_parameter_servers_over_hosts_from_the_end_of_each_host():
    assert choose_ps(WORKERS, 1) == ["tcp://10.0.0.1:4002"]
    assert choose_ps(WORKERS, 2) == ["tcp://10.0.0.1:4002", "tcp://10.0.0.2:4002"]  # one per host
    assert choose_ps(WORKERS, 3) == ["tcp://10.0.0.1:4002", "tcp://10.0.0.2:4002", "tcp://10.0.0.1:4001"]
    assert choose_ps(WORKERS, 0) == []
    with pytest.raises(ValueError, match="There must be at least one worker"):
        choose_ps(WORKERS, 4)
    with pytest.raises(ValueError, match="num_ps must be >= 0"):
        choose_ps(WORKERS, -1)


def test_a_tf_config_style_spec_with_ps_selects_ps_and_workers_by_host_port():
    ps, workers = select_ps_roles(ClusterSpec({"ps": ["10.0.0.2:4002"], "worker": ["h1", "10.0.0.2:4001"]}), WORKERS)
    assert ps == ["tcp://10.0.0.2:4002"]
    assert workers == ["tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.2:4001"]
    ps, workers = select_ps_roles(ClusterSpec({"ps": ["h2"], "worker": ["h2"]}), WORKERS)  # a host: the rest of it
    assert ps == ["tcp://10.0.0.2:4001"] and workers == ["tcp://10.0.0.2:4002"]
    with pytest.raises(ValueError, match="ps entry 'h3:1' matches no free Dask worker"):
        select_ps_roles(ClusterSpec({"ps": ["h3:1"], "worker": ["h1"]}), WORKERS)
    with pytest.raises(ValueError, match="both name the Dask worker"):
        select_ps_roles(ClusterSpec({"ps": ["10.0.0.1:4001"], "worker": ["10.0.0.1:4001"]}), WORKERS)


@pytest.mark.timeout(60)
def test_dask_cluster_resolver_with_num_ps_lists_ps_and_workers_and_refuses_bad_k():
    import logging

    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster, set_as_default=False) as client:
        info = scheduler_workers(client)
        ordered = sorted(info, key=lambda a: info[a]["name"])
        resolver = DaskClusterResolver(client, num_ps=1)
        spec = resolver.cluster_spec()
        assert spec.as_dict() == {"ps": [ordered[-1]], "worker": ordered[:-1]}  # the last worker of the host
        assert resolver.num_ps == 1 and "num_ps=1" in repr(resolver)
        assert resolver.num_accelerators("ps", 0) == {} and resolver.num_accelerators("worker", 1) == {}
        with pytest.raises(ValueError, match="does not use parameter servers"):
            resolver.hosts()
        with pytest.raises(ValueError, match="does not use parameter servers"):
            dd.MultiWorkerMirroredStrategy(resolver, client=client)
        explicit = DaskClusterResolver(client, ps=[ordered[0]])
        assert explicit.cluster_spec().as_dict() == {"ps": [ordered[0]], "worker": ordered[1:]}
        with pytest.raises(ValueError, match="There must be at least one worker"):
            DaskClusterResolver(client, num_ps=3).cluster_spec()
        with pytest.raises(ValueError, match="There must be at least one worker"):
            dd.ParameterServerStrategy(DaskClusterResolver(client, num_ps=3))
        with pytest.raises(ValueError, match="num_ps must be >= 0"):
            DaskClusterResolver(client, num_ps=-1)
        with pytest.raises(TypeError, match="num_ps must be an int"):
            DaskClusterResolver(client, num_ps=1.5)
        with pytest.raises(ValueError, match="not workers of the cluster"):
            DaskClusterResolver(client, ps=["tcp://10.255.255.1:1"]).cluster_spec()
        cluster.scale(4)
        client.wait_for_workers(4)
        grown = resolver.cluster_spec().as_dict()
        assert grown["ps"] == [ordered[-1]] and len(grown["worker"]) == 3  # the ps kept; the newcomer works
