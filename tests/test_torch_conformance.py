"""torch.distributed on daskdist, side by side with gloo in the same replicas (2 and 3 ranks).

Each replica holds torch's default group on the ``daskdist`` backend and a
gloo group of the same ranks made through the same store
(``new_group(backend="gloo")``), plus a subgroup of each. A check is a
function of a group; it runs on gloo and on daskdist, and the replica returns
both outcomes (a value, or the error's type). Where gloo succeeds, daskdist
must give the same value; where gloo refuses what daskdist carries (AVG,
strided views, list all_to_all, ...) daskdist must give the value the check
computes itself (``reference``); where there is no reference, both must refuse.
One strategy per world size serves the module; every test is one
``strategy.run`` with many checks.
"""

from __future__ import annotations

import datetime
import functools
import pickle
import time

import numpy as np
import pytest

import daskdist as dd

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

BACKENDS = ("gloo", "daskdist")
_GROUPS: dict = {}  # in each replica process: backend (or backend/sub) -> torch group


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def strategy(request):
    client = request.getfixturevalue("process_client" if request.param == 2 else "forked_process_client")
    with dd.MirroredStrategy(client=client) as strategy:
        strategy.run(_setup)
        yield strategy


def _setup():
    torch.set_num_threads(1)
    _GROUPS.clear()
    _GROUPS["daskdist"] = dd.plugins.torch.init_process_group()
    _GROUPS["gloo"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    sub = [0, world - 1]  # ranks 0 and the last: a subgroup that leaves rank 1 out at 3 ranks
    _GROUPS["daskdist/sub"] = dist.new_group(sub)
    _GROUPS["gloo/sub"] = dist.new_group(sub, backend="gloo")


def _pickled(fn, *args):
    return pickle.dumps(fn(*args))  # one leaf: the replicas' results differ in structure (root-only values)


def _run(strategy, fn, *args):
    return [pickle.loads(r) for r in strategy.experimental_local_results(strategy.run(_pickled, args=(fn, *args)))]


# -- the comparison ----------------------------------------------------------------------


def _plain(value):
    """What a check returns, as comparable plain data (tensors keep their dtype's name)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return ("tensor", str(t.dtype), list(t.shape), t.float().tolist() if t.dtype == torch.bfloat16 else t.tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _outcome(fn, group, backend):
    try:
        return "ok", _plain(fn(group, backend))
    except Exception as e:  # noqa: BLE001 - the outcome compared is the error's type
        return "error", f"{type(e).__name__}: {e}"


def _compare(checks, groups=("gloo", "daskdist")):
    """In a replica: each check on gloo then daskdist, with its reference: [(name, gloo, daskdist, reference)]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for name, fn, reference in checks:
        gloo = _outcome(fn, _GROUPS[groups[0]], "gloo")
        ours = _outcome(fn, _GROUPS[groups[1]], "daskdist")
        try:
            expected = _plain(reference(rank, world)) if reference is not None else None
        except (TypeError, RuntimeError):  # no meaning for these values: daskdist must refuse too
            expected = None
        out.append((name, gloo, ours, expected))
    return out


#: checks whose floats may round differently with the order of a sum of 3 (gradients compressed to 16 bits)
TOLERANCE = {"DDP fp16": 2e-3, "DDP bf16": 2e-2}


def _close(a, b, rtol=1e-6):
    if isinstance(a, float) and isinstance(b, float):
        return a == b or np.isclose(a, b, rtol=rtol, atol=rtol / 10) or (np.isnan(a) and np.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rtol) for k in a)
    return a == b


def _disagreements(results):
    """Over every replica's comparisons, what breaks the rule: daskdist equals the check's reference where it
    has one (gloo may be wrong there: it reads a strided view as contiguous memory), else gloo's value; where
    neither exists (gloo refuses, no reference), daskdist refuses too."""
    bad, checked = [], 0
    for rank, rows in enumerate(results):
        for name, gloo, ours, expected in rows:
            checked += 1
            right = ("ok", expected) if expected is not None else gloo if gloo[0] == "ok" else None
            if right is None:
                if ours[0] != "error":
                    bad.append(f"rank {rank} {name}: gloo refused ({gloo[1][:80]}) but daskdist gave {ours}")
            elif ours[0] != "ok" or not _close(ours[1], right[1], TOLERANCE.get(name, 1e-6)):
                bad.append(f"rank {rank} {name}: daskdist {ours}, expected {right} (gloo {gloo})")
    return bad, checked


def _assert_agree(strategy, fn, *args, at_least=1):
    results = _run(strategy, fn, *args)
    bad, checked = _disagreements(results)
    assert checked >= at_least * len(results), checked
    assert not bad, "\n".join(bad)
    return results


# -- reduce ops and dtypes -----------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool)
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")


def _values(rank, dtype):
    base = torch.tensor([1, 2, 3, 0, 5, 6]) + rank
    if dtype == torch.bool:
        return (base % 2).bool()
    return base.to(dtype)


def _op_reference(op, dtype):
    """What ``all_reduce`` must give where gloo refuses (AVG, int16): computed here from every rank's values.

    AVG is the sum divided by the world, truncated for integers; an op that has no meaning for the dtype
    (bitwise ops of floats, AVG of bools) raises here, and daskdist must refuse it too.
    """
    def reference(rank, world):
        parts = [_values(r, dtype) for r in range(world)]
        if op in ("BAND", "BOR", "BXOR"):
            ufunc = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
            return functools.reduce(ufunc, parts)
        if dtype == torch.bool:
            if op == "AVG":
                raise TypeError("no mean of bools")
            stacked = torch.stack(parts)
            return {"SUM": stacked.any(0), "MAX": stacked.any(0), "PRODUCT": stacked.all(0),
                    "MIN": stacked.all(0)}[op]
        wide = torch.stack([p.to(torch.float64 if dtype.is_floating_point else torch.int64) for p in parts])
        if op == "AVG":
            mean = wide.double().sum(0) / world
            return (mean if dtype.is_floating_point else torch.trunc(mean)).to(dtype)
        return {"SUM": wide.sum(0), "PRODUCT": wide.prod(0), "MIN": wide.min(0).values,
                "MAX": wide.max(0).values}[op].to(dtype)

    return reference


def _reduce_checks():
    checks = []
    for dtype in DTYPES:
        for op in OPS:
            def check(group, backend, dtype=dtype, op=op):
                t = _values(dist.get_rank(), dtype)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
                return t

            checks.append((f"all_reduce {op} {dtype}", check, _op_reference(op, dtype)))
    return _compare(checks)


def test_every_reduce_op_and_dtype(strategy):
    """SUM/MIN/MAX/PRODUCT/BAND/BOR/BXOR agree with gloo for every dtype it carries (bfloat16 too); AVG (which
    gloo refuses) is the mean; bitwise ops of floats and AVG of bools are refused by both."""
    _assert_agree(strategy, _reduce_checks, at_least=len(DTYPES) * len(OPS))


def _named_op_error():
    dd.plugins.torch.init_process_group()
    messages = []
    for call in (lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
                 lambda: dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(dist.get_world_size()),
                                                    op=dist.ReduceOp.BAND)):
        try:
            call()
            messages.append("accepted")
        except Exception as e:  # noqa: BLE001
            messages.append(str(e))
    return messages


def test_a_refused_op_is_named(strategy):
    for premul, band in _run(strategy, _named_op_error):
        assert "ReduceOp.PREMUL_SUM" in premul and "object at" not in premul, premul
        assert "ReduceOp.BAND" in band and "object at" not in band, band


# -- every collective, views, empty and 0-d tensors ---------------------------------------------


def _rank_tensor(shape, offset=0.0):
    return torch.arange(float(np.prod(shape))).reshape(shape) + 10 * dist.get_rank() + offset


def _collective_checks():
    rank, world = dist.get_rank(), dist.get_world_size()

    def all_reduce_strided(group, backend):
        base = _rank_tensor((4, 6))
        dist.all_reduce(base[:, ::2], group=group)  # a non-contiguous view: only its elements change
        return base

    def strided_reference(r, w):
        base = torch.arange(24.0).reshape(4, 6) + 10 * r
        base[:, ::2] = sum(torch.arange(24.0).reshape(4, 6)[:, ::2] + 10 * k for k in range(w))
        return base

    def all_reduce_transposed(group, backend):
        base = _rank_tensor((3, 5))
        dist.all_reduce(base.t(), op=dist.ReduceOp.MAX, group=group)
        return base

    def broadcast_strided(group, backend):
        base = _rank_tensor((4, 6))
        dist.broadcast(base[1:, 1::2], src=world - 1, group=group)
        return base

    def broadcast_strided_reference(r, w):
        base = torch.arange(24.0).reshape(4, 6) + 10 * r
        base[1:, 1::2] = (torch.arange(24.0).reshape(4, 6) + 10 * (w - 1))[1:, 1::2]
        return base

    def all_gather_into_strided(group, backend):
        out = torch.zeros(world, 2, 3)
        views = [out[i].t() for i in range(world)]  # non-contiguous outputs
        dist.all_gather(views, _rank_tensor((3, 2)), group=group)
        return out

    def offset_view(group, backend):
        base = _rank_tensor((3, 4))
        dist.all_reduce(base[1], group=group)  # contiguous, not at its storage's start
        return base

    def zero_d(group, backend):
        t = torch.tensor(float(rank + 1))
        dist.all_reduce(t, group=group)
        b = torch.tensor(rank * 3)
        dist.broadcast(b, src=world - 1, group=group)
        gathered = [torch.tensor(0.0) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor(float(rank)), group=group)
        return [t, b, gathered]

    def empty(group, backend):
        t = torch.empty(0)
        dist.all_reduce(t, group=group)
        b = torch.empty(0, 3)
        dist.broadcast(b, src=0, group=group)
        gathered = [torch.empty(0) for _ in range(world)]
        dist.all_gather(gathered, torch.empty(0), group=group)
        return [t, b, gathered]

    def all_reduce_coalesced(group, backend):
        ts = [_rank_tensor((2,)), _rank_tensor((3,))]  # (torch refuses mixed dtypes for every backend)
        dist.all_reduce_coalesced(ts, group=group)
        return ts

    def reduce(group, backend):
        t = _rank_tensor((5,))
        dist.reduce(t, dst=world - 1, op=dist.ReduceOp.MAX, group=group)
        return t if rank == world - 1 else None

    def broadcast(group, backend):
        t = _rank_tensor((2, 3)).long()
        dist.broadcast(t, src=1, group=group)
        return t

    def all_gather(group, backend):
        out = [torch.zeros(2, 2) for _ in range(world)]
        dist.all_gather(out, _rank_tensor((2, 2)), group=group)
        return out

    def all_gather_into_tensor(group, backend):
        out = torch.zeros(world * 2, 3)
        dist.all_gather_into_tensor(out, _rank_tensor((2, 3)), group=group)
        return out

    def reduce_scatter(group, backend):
        out = torch.zeros(3)
        dist.reduce_scatter(out, [_rank_tensor((3,), i) for i in range(world)], group=group)
        return out

    def reduce_scatter_reference(r, w):
        return sum(torch.arange(3.0) + 10 * k + r for k in range(w))

    def reduce_scatter_tensor(group, backend):
        out = torch.zeros(2)
        dist.reduce_scatter_tensor(out, _rank_tensor((2 * world,)), group=group)
        return out

    def reduce_scatter_tensor_reference(r, w):
        return sum(torch.arange(2.0 * w) + 10 * k for k in range(w))[2 * r:2 * r + 2]

    def gather(group, backend):
        out = [torch.zeros(3) for _ in range(world)] if rank == 0 else None
        dist.gather(_rank_tensor((3,)), out, dst=0, group=group)
        return out

    def scatter(group, backend):
        out = torch.zeros(2)
        dist.scatter(out, [torch.full((2,), 7.0 + i) for i in range(world)] if rank == world - 1 else None,
                     src=world - 1, group=group)
        return out

    def all_to_all_single(group, backend):
        out = torch.zeros(2 * world)
        dist.all_to_all_single(out, _rank_tensor((2 * world,)), group=group)
        return out

    def all_to_all_single_uneven(group, backend):  # member i sends i + 1 rows to each member
        out = torch.zeros(sum(range(1, world + 1)), 2)
        source = _rank_tensor(((rank + 1) * world, 2))
        dist.all_to_all_single(out, source, [i + 1 for i in range(world)], [rank + 1] * world, group=group)
        return out

    def all_to_all(group, backend):
        out = [torch.zeros(2) for _ in range(world)]
        dist.all_to_all(out, [_rank_tensor((2,), 100 * i) for i in range(world)], group=group)
        return out

    def all_to_all_reference(r, w):
        return [torch.arange(2.0) + 10 * k + 100 * r for k in range(w)]

    def barriers(group, backend):  # (monitored_barrier: torch allows it on gloo only)
        dist.barrier(group=group)
        dist.barrier(group=group, async_op=True).wait()
        return "passed"

    return _compare([
        ("all_reduce of a strided view", all_reduce_strided, strided_reference),
        ("all_reduce MAX of a transposed view", all_reduce_transposed,
         lambda r, w: (torch.arange(15.0).reshape(3, 5) + 10 * (w - 1))),
        ("broadcast of a strided view", broadcast_strided, broadcast_strided_reference),
        ("all_gather into strided outputs", all_gather_into_strided,
         lambda r, w: torch.stack([(torch.arange(6.0).reshape(3, 2) + 10 * k).t() for k in range(w)])),
        ("all_reduce of an offset view", offset_view, None),
        ("0-d tensors", zero_d, None),
        ("empty tensors", empty, None),
        ("all_reduce_coalesced", all_reduce_coalesced, None),
        ("reduce MAX", reduce, None),
        ("broadcast", broadcast, None),
        ("all_gather", all_gather, None),
        ("all_gather_into_tensor", all_gather_into_tensor, None),
        ("reduce_scatter", reduce_scatter, reduce_scatter_reference),
        ("reduce_scatter_tensor", reduce_scatter_tensor, reduce_scatter_tensor_reference),
        ("gather", gather, None),
        ("scatter", scatter, None),
        ("all_to_all_single", all_to_all_single, None),
        ("all_to_all_single, uneven splits", all_to_all_single_uneven, None),
        ("all_to_all (lists)", all_to_all, all_to_all_reference),
        ("barrier", barriers, None),
    ])


def test_every_collective_with_views_empty_and_0d_tensors(strategy):
    _assert_agree(strategy, _collective_checks, at_least=20)


# -- object collectives, p2p, async work, subgroups ----------------------------------------------


def _object_p2p_async_checks():
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world

    def object_collectives(group, backend):
        everyone = [None] * world
        dist.all_gather_object(everyone, {"rank": rank, "text": "x" * rank}, group=group)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(("from", rank), gathered, dst=0, group=group)
        objects = [f"root {rank}", rank] if rank == 1 else [None, None]
        dist.broadcast_object_list(objects, src=1, group=group)
        received = [None]
        dist.scatter_object_list(received, [{"to": i} for i in range(world)] if rank == 0 else None, src=0,
                                 group=group)
        return [everyone, gathered, objects, received]

    def object_p2p(group, backend):
        if rank == 0:
            dist.send_object_list([{"hello": 1}, "there"], dst=1, group=group)
            return None
        if rank == 1:
            got = [None, None]
            dist.recv_object_list(got, src=0, group=group)
            return got
        return None

    def ring_send_recv(group, backend):
        out = torch.zeros(3)
        if rank % 2 == 0:  # blocking calls in an order that cannot deadlock
            dist.send(_rank_tensor((3,)), dst=right, group=group)
            dist.recv(out, src=left, group=group)
        else:
            dist.recv(out, src=left, group=group)
            dist.send(_rank_tensor((3,)), dst=right, group=group)
        return out

    def tagged_isend_irecv(group, backend):
        outs = [torch.zeros(2), torch.zeros(2)]
        works = [dist.isend(_rank_tensor((2,), 1), dst=right, group=group, tag=7),
                 dist.isend(_rank_tensor((2,), 2), dst=right, group=group, tag=8),
                 dist.irecv(outs[1], src=left, group=group, tag=8),
                 dist.irecv(outs[0], src=left, group=group, tag=7)]
        for w in works:
            w.wait()
        return outs

    def batch_p2p(group, backend):
        out = torch.zeros(2, 2)
        ops = [dist.P2POp(dist.isend, _rank_tensor((2, 2)), right, group),
               dist.P2POp(dist.irecv, out, left, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return out

    def async_work(group, backend):
        a, b = _rank_tensor((4,)), _rank_tensor((2,)).double()
        w1 = dist.all_reduce(a, async_op=True, group=group)
        w2 = dist.broadcast(b, src=0, async_op=True, group=group)
        w3 = dist.all_reduce(torch.ones(1), async_op=True, group=group)
        w2.wait()
        w1.wait()
        value = w3.get_future().wait()
        return [a, b, w1.is_completed(), w2.is_success(), value]

    def async_errors_at_wait(group, backend):
        """A refused tensor raises at the call on both backends (nothing is sent)."""
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX, async_op=True, group=group)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__
        return "accepted"

    return _compare([
        ("object collectives", object_collectives, None),
        ("send_object_list / recv_object_list", object_p2p, None),
        ("send / recv around the ring", ring_send_recv, None),
        ("isend / irecv under tags", tagged_isend_irecv, None),
        ("batch_isend_irecv", batch_p2p, None),
        ("async work", async_work, None),
        ("a refused op of async work", async_errors_at_wait, None),
    ])


def test_object_collectives_p2p_batch_p2p_and_async_work(strategy):
    _assert_agree(strategy, _object_p2p_async_checks, at_least=7)


def _subgroup_checks():
    rank = dist.get_rank()
    names = {"gloo": "gloo/sub", "daskdist": "daskdist/sub"}

    def subgroup(group, backend):
        sub = _GROUPS[names[backend]]
        if sub == dist.GroupMember.NON_GROUP_MEMBER:
            return "not a member"
        t = _rank_tensor((3,))
        dist.all_reduce(t, group=sub)
        b = _rank_tensor((2,))
        dist.broadcast(b, group_src=1, group=sub)
        objects = [None, None]
        dist.all_gather_object(objects, rank, group=sub)
        return [t, b, objects, dist.get_rank(sub), dist.get_world_size(sub), dist.get_process_group_ranks(sub),
                dist.get_global_rank(sub, 1)]

    def sequence_numbers(group, backend):
        before = group._get_sequence_number_for_group()
        for _ in range(3):
            dist.all_reduce(torch.ones(2), group=group)
        return group._get_sequence_number_for_group() - before

    def group_identity(group, backend):
        return [dist.get_world_size(group), dist.get_rank(group), group.size(), group.rank()]

    return _compare([
        ("a subgroup (ranks 0 and the last)", subgroup, None),
        ("sequence numbers count the group's collectives", sequence_numbers, None),
        ("group identity", group_identity, None),
    ])


def test_subgroups_and_sequence_numbers(strategy):
    results = _assert_agree(strategy, _subgroup_checks, at_least=3)
    if len(results) == 3:
        assert results[1][0][2] == ("ok", "not a member")


# -- the store -------------------------------------------------------------------------------


def _store_checks():
    rank, world = dist.get_rank(), dist.get_world_size()
    ports = [None] * world
    tcp = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
    dist.all_gather_object(ports, tcp.port if tcp is not None else None)
    if tcp is None:
        tcp = dist.TCPStore("127.0.0.1", ports[0], world, is_master=False)
    # the group's own store (torch's PrefixStore over a Python store lacks delete_key: torch's trampoline)
    stores = {"gloo": tcp, "daskdist": dd.plugins.torch.backend.daskdist_store()}

    def store_ops(_, backend):
        store = stores[backend]
        store.set(f"k{rank}", f"v{rank}")
        store.wait([f"k{(rank + 1) % world}"], datetime.timedelta(seconds=30))
        counted = store.add("count", rank + 1)
        dist.barrier(group=_GROUPS[backend])
        swapped = store.compare_set("cas", "", f"first {rank}") if rank == 0 else None
        dist.barrier(group=_GROUPS[backend])
        kept = store.compare_set("cas", "wrong", "never")
        deleted = store.delete_key(f"k{rank}") if rank == 0 else None
        dist.barrier(group=_GROUPS[backend])
        try:
            store.wait(["never"], datetime.timedelta(seconds=0.2))
            missing = "found"
        except Exception as e:  # noqa: BLE001
            missing = type(e).__name__
        return [store.get(f"k{(rank + 1) % world}") if (rank + 1) % world else None, int(store.get("count")),
                counted >= rank + 1, store.check(["count"]),
                store.check(["k0"]), swapped, kept, deleted, missing]

    return _compare([("store", store_ops, None)])


def test_the_store_agrees_with_tcpstore(strategy):
    _assert_agree(strategy, _store_checks)


# -- DDP variants and ZeRO -----------------------------------------------------------------


class _Net(torch.nn.Module):
    """Three layers, and a fourth that a forward may leave out (``find_unused_parameters``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        self.extra = torch.nn.Linear(3, 3)

    def forward(self, x, skip_extra=False):
        h = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return h if skip_extra else self.extra(h)


def _train(group, variant, steps=3):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    net = _Net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(rank)  # DDP's construction broadcasts rank 0's weights
    ddp = DistributedDataParallel(net, process_group=group, bucket_cap_mb=0.0005,
                                  find_unused_parameters=variant == "find_unused",
                                  gradient_as_bucket_view=variant == "bucket_view", static_graph=variant == "static_graph")
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
             "allreduce_hook": default_hooks.allreduce_hook}
    if variant in hooks:
        ddp.register_comm_hook(group, hooks[variant])
    if variant == "zero":
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                                            momentum=0.9, process_group=group)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    loss = torch.nn.functional.cross_entropy
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        if variant == "no_sync":  # two micro-batches: the first accumulates locally, the second all-reduces
            with ddp.no_sync():
                loss(ddp(x[:4]), y[:4]).backward()
            loss(ddp(x[4:]), y[4:]).backward()
        else:
            loss(ddp(x, skip_extra=variant == "find_unused"), y).backward()
        optimizer.step()
    params = [p.detach().clone() for p in net.parameters()]
    del ddp, optimizer
    return params


DDP_VARIANTS = ("plain", "no_sync", "find_unused", "bucket_view", "static_graph", "allreduce_hook", "fp16", "bf16",
                "zero")


def _ddp_checks():
    checks = [(f"DDP {variant}", lambda group, backend, v=variant: _train(group, v), None) for variant in DDP_VARIANTS]
    return _compare(checks)


def test_ddp_variants_and_zero_train_as_on_gloo(strategy):
    results = _assert_agree(strategy, _ddp_checks, at_least=len(DDP_VARIANTS))
    for name, _, ours, _ in results[0]:  # and the replicas end equal
        for rank_rows in results[1:]:
            other = next(row for row in rank_rows if row[0] == name)
            assert other[2] == ours, name  # bit for bit


# -- timeout, abort, shutdown ------------------------------------------------------------------


def _skipped(backend, seconds):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds)) if backend == "gloo"
             else dist.new_group(timeout=datetime.timedelta(seconds=seconds)))
    dist.all_reduce(torch.ones(1), group=group)  # every member reached the group
    start = time.monotonic()
    try:
        if rank == world - 1:
            time.sleep(seconds + 1.5)  # skips the all-reduce, then joins a barrier the others never reach
            dist.barrier(group=group)
        else:
            dist.all_reduce(torch.ones(3), group=group)
    except Exception as e:  # noqa: BLE001
        return "raised", time.monotonic() - start, f"{type(e).__name__}: {e}"
    return "returned", time.monotonic() - start, ""


def test_a_skipped_collective_raises_on_every_member_within_the_timeout(strategy):
    """gloo and daskdist under a 1 s group timeout: the members that wait raise within it, and so does the one that
    skipped at its next collective; daskdist's message names the member and the collective."""
    world, timeout = strategy.num_replicas_in_sync, 1.0
    for backend in BACKENDS:
        results = _run(strategy, _skipped, backend, timeout)
        assert [r[0] for r in results] == ["raised"] * world, (backend, results)
        for _, seconds, message in results[:-1]:
            assert timeout - 0.5 < seconds < timeout + 4, (backend, seconds, message)
        if backend == "daskdist":
            for _, _, message in results[:-1]:
                assert f"replica {world - 1}" in message and "all_reduce" in message, message
            assert results[-1][1] < timeout + 1.5 + 2, results[-1]  # at once after its sleep: the abort reached it


def _abort(n_queued):
    dd.plugins.torch.init_process_group()
    rank = dist.get_rank()
    group = dist.new_group()  # threaded (the test's setting): its async work runs on the group's thread
    dist.all_reduce(torch.ones(1), group=group)
    raised = []
    if rank == 0:
        works = [dist.all_reduce(torch.ones(4), group=group, async_op=True) for _ in range(1 + n_queued)]
        time.sleep(0.5)  # the others have not joined: the first is in flight, the rest queued
        group.abort()
        for w in works:
            try:
                w.wait()
                raised.append("returned")
            except Exception as e:  # noqa: BLE001
                raised.append(type(e).__name__)
        try:
            dist.all_reduce(torch.ones(1), group=group)
            after = "returned"
        except RuntimeError as e:
            after = str(e)
        return raised, after
    time.sleep(1.5)
    try:
        dist.all_reduce(torch.ones(4), group=group)  # the abort reached this member first
        return ["returned"], ""
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__], str(e)


def test_abort_fails_in_flight_and_queued_work_on_every_member(strategy):
    import dask

    with dask.config.set({"daskdist.torch.comm-thread": True}):
        results = _run(strategy, _abort, 2)
    raised, after = results[0]
    assert len(raised) == 3 and "returned" not in raised, raised
    assert "aborted" in after, after
    for other, message in results[1:]:
        assert other != ["returned"] and "aborted" in message, (other, message)


def _shutdown():
    dd.plugins.torch.init_process_group()
    group = dist.new_group()
    t = torch.ones(3)
    work = dist.all_reduce(t, group=group, async_op=True)
    group.shutdown()  # drains: the work issued before it is over
    done = work.is_completed()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        after = "returned"
    except RuntimeError as e:
        after = str(e)
    return done, t.tolist(), after


def test_shutdown_drains_then_refuses(strategy):
    world = strategy.num_replicas_in_sync
    for done, values, after in _run(strategy, _shutdown):
        assert done and values == [float(world)] * 3
        assert "shut down" in after, after
