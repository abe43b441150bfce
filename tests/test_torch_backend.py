"""daskdist as a torch.distributed backend: init, every supported op, stock DDP and friends (real processes).

torch's default group is process-global, so these tests use a cluster of
worker processes (one replica each). Skipped without torch.
"""

from __future__ import annotations

import json
import os
import signal
import time

import dask
import numpy as np
import pytest

import daskdist as dd
from tests.support.killers import RunInBackground, lines_of, wait_for_files, worker_pid

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

STEPS = 4
GLOBAL_BATCH = 16


def _direct_ops():
    dd.plugins.torch.init_process_group()
    r, w = dist.get_rank(), dist.get_world_size()
    out = {"init": (dist.is_initialized(), r, w, dist.get_backend())}
    for name, op in [("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("min", dist.ReduceOp.MIN),
                     ("max", dist.ReduceOp.MAX), ("prod", dist.ReduceOp.PRODUCT)]:
        t = torch.full((4,), float(r + 2))
        dist.all_reduce(t, op=op)
        out[name] = t.tolist()
    t = torch.full((2,), float(r))
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["async"] = (t.tolist(), work.is_completed())
    big = torch.arange(300_000, dtype=torch.float32) + r  # 1.2 MB: reduced where it lies (in place)
    pointer = big.data_ptr()
    dist.all_reduce(big)
    bigger = torch.arange(300_000, dtype=torch.float32) + r
    work = dist.all_reduce(bigger, async_op=True)
    future_value = work.get_future().wait()[0]
    work.wait()
    expected = 2 * torch.arange(300_000, dtype=torch.float32) + 1
    out["big"] = [bool(torch.equal(big, expected)), big.data_ptr() == pointer, bool(torch.equal(bigger, expected)),
                  future_value.data_ptr() == bigger.data_ptr()]
    kept = torch.arange(300_000, dtype=torch.float32) + r
    dist.reduce(kept, dst=0)
    out["big_reduce"] = bool(torch.equal(kept, expected if r == 0 else torch.arange(300_000, dtype=torch.float32) + r))
    ts = [torch.ones(2) * r, torch.ones(3) * (r + 1)]
    dist.all_reduce_coalesced(ts)
    out["coalesced"] = [x.tolist() for x in ts]
    t = torch.full((3,), float(r))
    dist.broadcast(t, src=1)
    out["broadcast"] = t.tolist()
    gathered = [torch.zeros(2) for _ in range(w)]
    dist.all_gather(gathered, torch.full((2,), float(r)))
    out["all_gather"] = [x.tolist() for x in gathered]
    o = torch.zeros(2 * w)
    dist.all_gather_into_tensor(o, torch.full((2,), float(r)))
    out["all_gather_into_tensor"] = o.tolist()
    o = torch.zeros(2)
    dist.reduce_scatter(o, [torch.full((2,), float(i + r)) for i in range(w)])
    out["reduce_scatter"] = o.tolist()
    o = torch.zeros(2)
    dist.reduce_scatter_tensor(o, torch.arange(2.0 * w) + r)
    out["reduce_scatter_tensor"] = o.tolist()
    t = torch.full((2,), float(r + 1))
    dist.reduce(t, dst=0)
    out["reduce"] = t.tolist() if r == 0 else None
    g = [torch.zeros(1) for _ in range(w)] if r == 0 else None
    dist.gather(torch.full((1,), float(r)), g, dst=0)
    out["gather"] = [x.tolist() for x in g] if g else None
    o = torch.zeros(1)
    dist.scatter(o, [torch.full((1,), float(i + 10)) for i in range(w)] if r == 0 else None, src=0)
    out["scatter"] = o.tolist()
    o = torch.zeros(w)
    dist.all_to_all_single(o, torch.arange(float(w)) + 10 * r)
    out["all_to_all_single"] = o.tolist()
    dist.barrier()
    if r == 0:
        dist.send(torch.arange(3.0), dst=1)
    else:
        t = torch.zeros(3)
        dist.recv(t, src=0)
        out["recv"] = t.tolist()
    sub = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    out["new_group"] = t.tolist()
    solo = dist.new_group([1])  # every rank calls it; rank 0 is not a member
    if r == 1:
        t = torch.full((1,), 7.0)
        dist.all_reduce(t, group=solo)
        out["solo"] = [t.tolist(), dist.get_rank(solo), dist.get_world_size(solo)]
    else:
        out["solo"] = solo == dist.GroupMember.NON_GROUP_MEMBER
    out["group_name"] = dist.distributed_c10d._get_default_group().group_name
    return json.dumps(out)  # one leaf: the replicas' results differ in structure (root-only keys)


@pytest.mark.parametrize("comm_thread", [False, True])
def test_every_supported_op_gives_the_right_values(process_client, comm_thread):
    """Inline, and with a communication thread (where ``async_op=False`` calls still run in the caller)."""
    with dask.config.set({"daskdist.torch.comm-thread": comm_thread}):
        with dd.MirroredStrategy(client=process_client) as strategy:
            results = [json.loads(r) for r in strategy.experimental_local_results(strategy.run(_direct_ops))]
    for r, out in enumerate(results):
        assert out["init"] == [True, r, 2, "daskdist"]
        assert out["big"] == [True, True, True, True] and out["big_reduce"] is True
        assert out["sum"] == [5.0] * 4 and out["avg"] == [2.5] * 4 and out["prod"] == [6.0] * 4
        assert out["min"] == [2.0] * 4 and out["max"] == [3.0] * 4
        assert out["async"] == [[1.0, 1.0], True]
        assert out["coalesced"] == [[1.0, 1.0], [3.0, 3.0, 3.0]]
        assert out["broadcast"] == [1.0] * 3
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert out["reduce_scatter"] == [[1.0, 1.0], [3.0, 3.0]][r]
        assert out["reduce_scatter_tensor"] == [[1.0, 3.0], [5.0, 7.0]][r]
        assert out["scatter"] == [10.0 + r]
        assert out["all_to_all_single"] == [[0.0, 10.0], [1.0, 11.0]][r]
        assert out["new_group"] == [2.0]
        assert out["group_name"]  # DeviceMesh and functional collectives look groups up by name
    assert results[0]["reduce"] == [3.0, 3.0]
    assert results[0]["gather"] == [[0.0], [1.0]]
    assert results[1]["recv"] == [0.0, 1.0, 2.0]
    assert results[0]["solo"] is True and results[1]["solo"] == [[7.0], 0, 1]


def _store_ops():
    import datetime

    dd.plugins.torch.init_process_group()
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    store.set(f"k{rank}", f"v{rank}")
    store.wait([f"k{1 - rank}"], datetime.timedelta(seconds=30))
    counted = store.add("count", 5)
    dist.barrier()
    return {"other": store.get(f"k{1 - rank}"), "count": int(store.get("count")), "added": counted,
            "check": store.check(["k0", "k1"]), "missing": store.check(["nope"])}


def test_the_store_is_served_by_the_scheduler(process_client):
    """torch's Store of the group (gloo or NCCL could meet through it): set/get/add/wait/check across replicas."""
    with dd.MirroredStrategy(client=process_client) as strategy:
        results = strategy.experimental_local_results(strategy.run(_store_ops))
    assert [r["other"] for r in results] == [b"v1", b"v0"]
    assert all(r["count"] == 10 and r["check"] and not r["missing"] for r in results)
    assert sorted(r["added"] for r in results) == [5, 10]


# -- DDP ----------------------------------------------------------------------------------


def _model(batch_norm=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(32))
    layers += [torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)]
    return torch.nn.Sequential(*layers).double()


def _batch(step):
    rng = np.random.default_rng(step)
    x = torch.from_numpy(rng.standard_normal((GLOBAL_BATCH, 8)))
    y = torch.from_numpy(rng.integers(0, 3, GLOBAL_BATCH))
    return x, y


def _reference(variant):
    """One process on the global batch: what every replica must end with."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = _batch(step)
        if variant == "no_sync":
            half = GLOBAL_BATCH // 2
            for part in (slice(0, half), slice(half, None)):
                torch.nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        else:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def _ddp_train(variant):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    dd.plugins.torch.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = _model()
    if rank == 1:  # DDP's construction broadcasts rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # a few small buckets
    hook_calls = []
    if variant == "hook":
        def hook(state, bucket):
            hook_calls.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
    if variant == "zero":
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    local = GLOBAL_BATCH // world
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = _batch(step)
        mine = slice(rank * local, (rank + 1) * local)
        if variant == "no_sync":  # two micro-batches: the first accumulates locally, the second all-reduces
            xs, ys = x[mine], y[mine]
            half = local // 2
            with ddp.no_sync():
                torch.nn.functional.cross_entropy(ddp(xs[:half]), ys[:half]).backward()
            torch.nn.functional.cross_entropy(ddp(xs[half:]), ys[half:]).backward()
        else:
            torch.nn.functional.cross_entropy(ddp(x[mine]), y[mine]).backward()
        optimizer.step()
    return [p.detach().numpy().copy() for p in model.parameters()], len(hook_calls)


@pytest.mark.parametrize("variant,comm_thread", [("plain", False), ("plain", True), ("no_sync", True),
                                                 ("hook", False), ("syncbn", True), ("zero", False)])
def test_ddp_matches_one_process_on_the_global_batch(process_client, variant, comm_thread):
    """Stock DDP over daskdist: equal parameters everywhere, equal to one process on the global batch."""
    if variant == "syncbn":  # a CPU model: DDP refuses it (on CUDA: tests/test_gpu_torch.py)
        # what docs/torch.md says: torch's SyncBatchNorm runs on CUDA (or privateuse1) modules only, and DDP
        # refuses it in a CPU module whatever the backend
        with dd.MirroredStrategy(client=process_client) as strategy:
            refusals = strategy.experimental_local_results(strategy.run(_sync_batch_norm_on_cpu))
        assert all("SyncBatchNorm layers only work with GPU modules" in r for r in refusals), refusals
        return
    with dask.config.set({"daskdist.torch.comm-thread": comm_thread}):
        with dd.MirroredStrategy(client=process_client) as strategy:
            results = strategy.experimental_local_results(strategy.run(_ddp_train, args=(variant,)))
    (w0, calls0), (w1, calls1) = results
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    for a, ref in zip(w0, _reference(variant)):
        np.testing.assert_allclose(a, ref, rtol=1e-6, atol=1e-12)
    if variant == "hook":
        assert calls0 == calls1 and calls0 >= STEPS * 2  # the hook carried every bucket (several per step)


def _sync_batch_norm_on_cpu():
    from torch.nn.parallel import DistributedDataParallel

    dd.plugins.torch.init_process_group()
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(_model(batch_norm=True))
    try:
        DistributedDataParallel(model)
    except ValueError as e:
        return str(e)
    return "accepted"


# -- bad input and failures ------------------------------------------------------------------


def _init_twice():
    first = dd.plugins.torch.init_process_group(timeout=60)
    again = dd.plugins.torch.init_process_group()  # a notebook re-runs the cell: the same group
    same_timeout = dd.plugins.torch.init_process_group(timeout=60)
    try:
        dd.plugins.torch.init_process_group(timeout=5)
    except ValueError as e:
        changed = str(e)
    else:
        changed = "accepted"
    return first is again is same_timeout is dist.group.WORLD, changed


def test_init_again_returns_the_group_and_outside_a_replica_raises(process_client):
    with pytest.raises(RuntimeError, match="inside a function run on the replicas"):
        dd.plugins.torch.init_process_group()
    with dd.MirroredStrategy(client=process_client) as strategy:
        results = strategy.experimental_local_results(strategy.run(_init_twice))
    for same, changed in results:
        assert same is True
        assert "timeout=5 s" in changed and "timeout=60.0 s" in changed, changed


def _initialised():
    import torch.distributed

    return torch.distributed.is_initialized()


def _init_and_sum():
    dd.plugins.torch.init_process_group()
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.tolist()


def test_a_closed_strategy_leaves_no_torch_group_and_a_new_strategy_inits_again(process_client):
    """The replica's close destroys the torch group it made (a close callback), not the next init."""
    with dd.MirroredStrategy(client=process_client) as strategy:
        assert list(strategy.experimental_local_results(strategy.run(_init_and_sum))) == [[2.0, 2.0]] * 2
        assert list(process_client.run(_initialised).values()) == [True, True]
    assert list(process_client.run(_initialised).values()) == [False, False]
    with dd.MirroredStrategy(client=process_client) as strategy:
        assert list(strategy.experimental_local_results(strategy.run(_init_and_sum))) == [[2.0, 2.0]] * 2


def _mismatched():
    dd.plugins.torch.init_process_group()
    r = dist.get_rank()
    t = torch.ones(3 + r, dtype=torch.float32 if r == 0 else torch.float64)
    dist.all_reduce(t)


def test_mismatched_shapes_and_dtypes_raise_naming_them(process_client):
    with dd.MirroredStrategy(client=process_client) as strategy:
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            strategy.run(_mismatched)
        assert time.monotonic() - start < 30
    message = str(info.value)
    print(type(info.value), message)
    assert "replica 0" in message and "replica 1" in message, message
    assert "float32" in message and "float64" in message, message
    assert "[3]" in message and "[4]" in message, message


def _needs_processes():
    dd.plugins.torch.init_process_group()


def test_threaded_replicas_get_a_clear_error(threaded_client):
    with dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=threaded_client) as strategy:
        with pytest.raises(RuntimeError, match="one replica per worker process"):
            strategy.run(_needs_processes)


@pytest.mark.slow
def test_a_killed_worker_fails_the_pending_torch_call_everywhere(make_cluster, tmp_path):
    client = make_cluster(3, processes=True)
    with dask.config.set({"daskdist.torch.comm-thread": True}):  # travels to the replicas with the group
        strategy = dd.MirroredStrategy(client=client)
    victim = strategy.extended.worker_addresses[1]
    pid = worker_pid(client, victim)
    log = tmp_path / "lost"

    def fn():
        dd.plugins.torch.init_process_group()
        rank = dist.get_rank()
        if rank == 1:
            (tmp_path / f"ready{rank}").write_text("")
            time.sleep(60)  # killed while the others wait in the all-reduce
        start = time.monotonic()
        try:
            # issued on the communication thread: once the call returns, the all-reduce is pending (rank 1
            # never joins it), and the ready file says so
            work = dist.all_reduce(torch.ones(1_000_000), async_op=True)
            (tmp_path / f"ready{rank}").write_text("")
            work.wait()
        except Exception as e:
            with open(log, "a") as f:
                f.write(f"{rank} {time.monotonic() - start:.2f} {type(e).__name__} {e}\n".replace("\n", " ") + "\n")
            raise

    run = RunInBackground(strategy, fn)
    wait_for_files(tmp_path, "ready*", 3)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    error = run.join(60)
    assert isinstance(error, dd.ReplicaLostError), repr(error)
    # the kill closes the victim's connections: found at once, not at a deadline; 20 s is load's margin
    assert run.at - killed_at < 20
    lines = lines_of(log, 2)
    assert sorted(line.split()[0] for line in lines) == ["0", "2"]  # every survivor's torch call raised
    assert all(float(line.split()[1]) < 30 for line in lines)  # issued before the kill, raised after it
    assert all(victim in line for line in lines), lines
    strategy.close()


def _cuda_all_reduce():
    torch.cuda.set_device(dist.get_rank() if dist.is_initialized() else dd.get_replica_context().replica_id_in_sync_group)
    dd.plugins.torch.init_process_group()
    t = torch.full((4,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    return t.cpu().tolist()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (torch's NCCL)")
def test_cuda_tensors_go_through_nccl(process_client):
    with dd.MirroredStrategy(client=process_client) as strategy:
        results = strategy.experimental_local_results(strategy.run(_cuda_all_reduce))
    assert results == [[3.0] * 4, [3.0] * 4]
