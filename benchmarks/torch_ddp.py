"""Stock DDP on the daskdist torch backend against DDP on gloo, and the backend's per-call overhead.

Both DDP arms run in the same worker processes (a LocalCluster of 2
single-threaded processes, one replica each, pinned as daskdist pins them),
on the same data, seed and global batch, with the same torch and threads; they
differ only in the process group: gloo (rendezvoused through daskdist's store,
so no port either) or ``daskdist``. Rounds alternate the arms. Models: the
tutorial CNN on 28x28 input (about 1.4 MB of gradients) and a gradient-heavy
MLP (3 Linear 2048x2048, about 50 MB). The final loss of each arm is printed
as a parity check. Per arm: the step time (wall), the CPU time of the replica's
process per step (every thread: the backend's and gloo's too) and, after the
timed steps, the same steps under DDP's ``no_sync`` (no communication: what a
step costs on a free network). Step minus no_sync step is the communication
that the step did not hide.

Then ``dist.all_reduce`` through the backend against ``ReplicaContext.all_reduce``
on the same replicas, 4 KiB and 64 MiB: the torch layer's cost per call.

    python benchmarks/torch_ddp.py --rounds 3 [--parts ddp,overhead] [--per-call-only] [--arm-timeout 240]

Across hosts (``--hosts netns``, as root): two network-namespace hosts
(``tests/netns.py``: own network, host name and ``/dev/shm`` each) with
``--per-host N`` single-threaded Dask workers each (default 1), a
``dd.MultiWorkerMirroredStrategy`` over them (one replica per worker, ranks
host by host: rank r on host r // N, checked), and for each of ``--rates``
(default 1gbit and 10gbit: every host's link shaped with ``tc ... tbf``) the
same rounds, the global batch split over the 2N replicas. The gloo arm there
is plain ``torch.distributed`` over the same 2N ranks: ``env://`` rendezvous
with ``MASTER_ADDR`` on rank 0's namespace address (host 0), a fresh
``MASTER_PORT`` per arm, ``GLOO_SOCKET_IFNAME=eth0``; the daskdist arm
rendezvouses through the scheduler as on one host (at N > 1 its all-reduce
is hierarchical: in-host shared memory, each host's gradient across once each
way). Its default parts: ``ddp``.

    python benchmarks/torch_ddp.py --hosts netns --rates 1gbit,10gbit --rounds 3 [--per-host 2]

Parity: the final losses of the arms are printed and checked. With 2
replicas both backends sum the same two gradients (bit-equal expected); with
more, gloo's ring and daskdist's hierarchy add in different orders, so the
losses must agree within ``LOSS_RTOL`` (relative).

Across hosts a third arm, ``bound``, runs in the same rotation on the same
hosts at the same time: the bare model (no DDP, no process group) with the
same optimizer, data and local batch, timed phase by phase (``zero_grad`` and
forward, backward, ``optimizer.step``). Every stock-DDP step does that work
and more (DDP's hooks, its bucket copies, the all-reduce), whatever the
backend, so it bounds any backend's step from below: more so than DDP under
``no_sync``, which still runs DDP's forward and hooks. Across a link the
bound adds the wire (``bound_steps``): between 2 hosts an exact all-reduce
carries each host's gradient once each way, at the link's rate in the long
run, and within a step after backward starts and before ``optimizer.step``
(past the token bucket's burst). And the CPU: both hosts share this
machine's cores, so a step takes at least the CPU both replicas spend on it
over the cores; the bound arm runs its steps again with the gradient's bytes
sent each way over a plain TCP connection after backward (the kernel's part
of any backend's all-reduce; ``bound_figures``); with N replicas per host,
replica i of host 0 and replica i of host 1 exchange the i-th of N slices
over their own connection (the host's gradient crosses once each way, as in
daskdist's hierarchy; the in-host sums are left out: a floor), and the CPU
floor is all 2N replicas' CPU over the cores. The bound is the larger
floor; ``gloo / bound`` is the most any backend could gain on gloo there.
The DDP table splits each arm's CPU per step: the replica thread's, and the
rest (the backend's threads, Dask's event loop).

``--windows 1,4``: one daskdist arm per ``daskdist.collective.async-window``
(async collectives in flight together), each against the same gloo arm;
arms rotate round by round. A window above 1 runs the backend's collectives
on the communication thread (``daskdist.torch.comm-thread: true``), where
DDP's buckets can be in flight together; window 1 keeps the configured
setting (``auto``: inline on a replica pinned to one core).

The load average (1 minute) is printed before each arm of each round and
goes into the tables, next to that arm's figures.

Every arm is bounded (``--arm-timeout`` seconds): gloo's group and its store,
and daskdist's collectives, get that timeout, so a stuck arm raises on the
replicas instead of waiting out gloo's 30 minutes; each replica dumps its
threads' stacks (``faulthandler``) to the worker's stderr when its arm runs
past the bound; and a watchdog on the client ends the benchmark, naming the
arm, if the arm has still not returned a minute later.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import itertools
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import daskdist as dd  # noqa: E402
from benchmarks._common import blas_in_use, format_table, local_cluster, namespace_cluster, print_header  # noqa: E402

GLOBAL_BATCH = 64
#: the arms' final losses agree within this (relative) when more than 2 replicas sum in different orders
LOSS_RTOL = 1e-4
#: gloo's first ``MASTER_PORT`` across namespace hosts (each arm takes the next: no wait for a closed store's port)
GLOO_PORT = 29500


#: further models measured after the CNN and the MLP: ``(name, steps)`` (``--resnet-steps N`` adds ResNet-18)
EXTRA_MODELS: list[tuple[str, int]] = []
#: ``--windows``: one daskdist arm per async window (empty: one arm, the configured window)
WINDOWS: list[int] = []


def _resnet18() -> Any:
    """ResNet-18 for 32x32 inputs (CIFAR's stem: one 3x3 convolution, no max-pool), written out: torchvision's
    registry wheel does not import beside the CPU torch. 11.2 M parameters, ~45 MB of gradients."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x) + self.skip(x))

    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


def _model(name: str) -> Any:
    import torch

    torch.manual_seed(0)
    if name == "resnet18":
        return _resnet18()
    if name == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
            torch.nn.Linear(32 * 13 * 13, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 2048))


def _batch(name: str, step: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(step)
    if name == "resnet18":
        x = rng.random((GLOBAL_BATCH, 3, 32, 32), dtype=np.float32)
        y = rng.integers(0, 10, GLOBAL_BATCH)
    elif name == "cnn":
        x = rng.random((GLOBAL_BATCH, 1, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, GLOBAL_BATCH)
    else:
        x = rng.standard_normal((GLOBAL_BATCH, 2048), dtype=np.float32)
        y = rng.integers(0, 2048, GLOBAL_BATCH)
    return torch.from_numpy(x), torch.from_numpy(y)


def ddp_arm(arm: str, name: str, steps: int, warmup: int, tag: str, bound: float,
            master_port: int | None = None) -> dict[str, Any]:
    """On a replica: ``steps`` DDP steps of ``name`` on backend ``arm``; step times and the last loss.

    ``bound``: the arm's timeout in seconds (gloo's and its store's; past it the replica dumps its stacks).
    ``master_port``: gloo rendezvouses as plain ``torch.distributed`` does across hosts (``env://``,
    ``MASTER_ADDR`` = rank 0's worker address, this port, ``GLOO_SOCKET_IFNAME=eth0``) instead of through
    daskdist's store.
    """
    import torch
    import torch.distributed as dist

    from daskdist import context
    from daskdist.plugins.torch.store import DaskdistStore

    torch.set_num_threads(1)
    runtime = context.current_runtime()
    timeout = datetime.timedelta(seconds=bound)
    faulthandler.dump_traceback_later(bound, exit=False)  # a stuck arm shows where, on the worker's stderr
    try:
        if arm == "gloo" and master_port is not None:
            os.environ.update(MASTER_ADDR=urlsplit(runtime.spec.addresses[0]).hostname or "",
                              MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME="eth0")
            dist.init_process_group("gloo", init_method="env://", rank=runtime.rank, world_size=runtime.size,
                                    timeout=timeout)
        elif arm == "gloo":
            store = DaskdistStore(runtime.worker, f"{runtime.group_id}/bench-{tag}", timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=runtime.rank, world_size=runtime.size, timeout=timeout)
        else:
            dd.plugins.torch.init_process_group(timeout=timeout)
        return _train(arm, name, steps, warmup)
    finally:
        faulthandler.cancel_dump_traceback_later()


def bound_arm(name: str, steps: int, warmup: int, port: int | None = None, per_host: int = 1) -> dict[str, Any]:
    """On a replica: the bare model's steps (no DDP, no communication), phase by phase; seconds per step.

    The same model, seed, optimizer, batches and local batch as ``_train``;
    returns ``fwd`` (``zero_grad``, forward and loss), ``bwd`` (backward),
    ``opt`` (``optimizer.step``), ``times`` (their sum) and ``cpu`` (the
    process's CPU, every thread) per timed step, and the gradient's bytes.
    ``port``: then the same steps again, each followed by the gradient's bytes
    sent to the other host and its received, over one plain TCP connection
    (``raw_cpu``: the process's CPU per step): what the kernel alone charges a
    backend with no software of its own. ``per_host`` replicas a host: each
    pair (replica i of either host) exchanges the i-th of ``per_host`` slices on
    port ``port + i``.
    """
    import torch

    from daskdist import context

    torch.set_num_threads(1)
    runtime = context.current_runtime()
    rank, world = runtime.rank, runtime.size
    model = _model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    local = GLOBAL_BATCH // world
    batches = [_batch(name, s) for s in range(steps + warmup)]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    phases: dict[str, list[float]] = {"fwd": [], "bwd": [], "opt": [], "times": [], "cpu": [], "raw_cpu": []}
    exchange = _RawExchange(runtime, port, grad_bytes, per_host) if port is not None else None
    try:
        for loop in ("bare", "raw") if exchange is not None else ("bare",):
            for s, (x, y) in enumerate(batches):
                xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
                start, start_cpu = time.perf_counter(), time.process_time()
                optimizer.zero_grad()
                out = torch.nn.functional.cross_entropy(model(xs), ys)
                forward = time.perf_counter()
                out.backward()
                backward = time.perf_counter()
                if exchange is not None and loop == "raw":
                    exchange.run()
                optimizer.step()
                end, cpu = time.perf_counter(), time.process_time() - start_cpu
                if s < warmup:
                    continue
                if loop == "raw":
                    phases["raw_cpu"].append(cpu)
                    continue
                phases["fwd"].append(forward - start)
                phases["bwd"].append(backward - forward)
                phases["opt"].append(end - backward)
                phases["times"].append(end - start)
                phases["cpu"].append(cpu)
    finally:
        if exchange is not None:
            exchange.close()
    return {**phases, "grad_bytes": grad_bytes}


class _RawExchange:
    """A slice of ``nbytes`` each way between replica i of host 0 and replica i of host 1 (ranks i and
    i + ``per_host``; the i-th of ``per_host`` slices) over one plain TCP connection: a sender thread and the
    caller's ``recv_into`` (no framing, no reduction: the kernel's part of any backend's all-reduce)."""

    def __init__(self, runtime: Any, port: int, nbytes: int, per_host: int = 1):
        import socket

        pair = runtime.rank % per_host
        host = urlsplit(runtime.spec.addresses[pair]).hostname or ""
        port += pair
        nbytes = nbytes // per_host + (nbytes % per_host if pair == per_host - 1 else 0)
        ctx = dd.get_replica_context()
        assert ctx is not None
        if runtime.rank < per_host:
            with socket.create_server((host, port)) as server:
                ctx.barrier()
                self.sock, _ = server.accept()
        else:
            ctx.barrier()
            self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out, self.into = bytearray(nbytes), memoryview(bytearray(nbytes))
        self.go, self.sent = threading.Semaphore(0), threading.Semaphore(0)
        self.thread = threading.Thread(target=self._send, daemon=True, name="bound-raw-send")
        self.thread.start()

    def _send(self) -> None:
        while True:
            self.go.acquire()
            if self.out is None:
                return
            self.sock.sendall(self.out)
            self.sent.release()

    def run(self) -> None:
        self.go.release()
        got = 0
        while got < len(self.into):
            got += self.sock.recv_into(self.into[got:])
        self.sent.acquire()

    def close(self) -> None:
        self.out = None  # type: ignore[assignment]
        self.go.release()
        self.thread.join()
        self.sock.close()


#: the token bucket of each namespace host's link (``tests/netns.py``: ``tbf ... burst 1mb``; tc reads 1048500 bytes)
TBF_BURST_BYTES = 1 << 20


def bound_steps(out: dict[str, Any], bits_per_second: float | None) -> list[float]:
    """Per step of ``bound_arm``'s ``out``: the least a stock-DDP step could take over a link of that rate.

    Each host's gradient crosses once each way (2 hosts, an exact all-reduce), ``wire`` = its bytes x
    1514/1448 (a full frame per TCP payload) / rate. Two floors, the larger holds: the link's long-run rate
    (step >= wire: a token bucket refills at the rate however long the step); and within the step, the bytes
    leave after backward starts and arrive before ``optimizer.step``, the first ``TBF_BURST_BYTES`` at once
    (the bucket, full after the forward pass), the rest at the rate: forward + step + max(backward, wire
    past the burst). ``None``: no link (the bare step).
    """
    if bits_per_second is None:
        return list(out["times"])
    frames = out["grad_bytes"] * 1514 / 1448
    wire, past_burst = frames * 8 / bits_per_second, max(0.0, frames - TBF_BURST_BYTES) * 8 / bits_per_second
    return [max(wire, f + o + max(b, past_burst)) for f, b, o in zip(out["fwd"], out["bwd"], out["opt"])]


def _bits_per_second(rate: str) -> float:
    """tc's rate (``1gbit``, ``100mbit``, ``10gbit``: 1000-based bits per second)."""
    number, unit = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.strip().lower()).groups()  # type: ignore[union-attr]
    return float(number) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[unit]


def _train(arm: str, name: str, steps: int, warmup: int) -> dict[str, Any]:
    """The DDP steps of one arm, then the group's teardown.

    The final loss is averaged with daskdist's ``ReplicaContext.all_reduce``
    in both arms, not with the arm's backend: a gloo all-reduce of a tensor
    that Python holds, right before the gloo group is destroyed, deadlocked a
    replica (a hang seen once). gloo's worker thread, dropping the finished
    work, releases the tensor and waits for the GIL; the replica thread,
    freeing the DDP model, runs ``~ProcessGroupGloo``, which joins that thread
    while holding the GIL (py-spy --native on the stuck replica showed both).
    The last gloo works are now DDP's own, whose bucket tensors Python never
    sees, and the model is freed before the group is destroyed.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model: Any = None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DistributedDataParallel(_model(name))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        local = GLOBAL_BATCH // world
        batches = [_batch(name, s) for s in range(steps + warmup)]
        times, cpu, others, loss = [], [], [], 0.0
        for s, (x, y) in enumerate(batches):
            xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
            start, start_cpu, start_own = time.perf_counter(), time.process_time(), time.thread_time()
            optimizer.zero_grad()
            out = torch.nn.functional.cross_entropy(model(xs), ys)
            out.backward()
            optimizer.step()
            if s >= warmup:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)  # every thread of the process: the backend's too
                others.append(cpu[-1] - (time.thread_time() - start_own))  # off the replica thread
            loss = float(out.detach())
        final = dd.get_replica_context().all_reduce("SUM", np.array([loss]))
        compute = []  # the same steps without communication (DDP's no_sync): what the step costs with a free network
        for x, y in batches[warmup:]:
            xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
            start = time.perf_counter()
            optimizer.zero_grad()
            with model.no_sync():
                out = torch.nn.functional.cross_entropy(model(xs), ys)
                out.backward()
            optimizer.step()
            compute.append(time.perf_counter() - start)
        return {"times": times, "cpu": cpu, "others": others, "compute": compute, "loss": float(final[0]) / world}
    finally:
        model = optimizer = out = None  # DDP's reducer (and its hold on the group) goes first
        if arm == "gloo":
            dist.destroy_process_group()
        else:
            dd.plugins.torch.destroy_process_group()


@contextmanager
def bounded(what: str, seconds: float) -> Iterator[None]:
    """End the benchmark with a message naming ``what`` if it has not returned within ``seconds``.

    The replicas' own timeouts end a stuck arm first (``--arm-timeout``); this
    is the last resort: SIGINT to this process, which closes the strategy and
    the cluster on the way out.
    """
    def expire() -> None:
        print(f"\n{what} did not return within {seconds:g} s: ending the benchmark (the replicas' stacks, "
              "if they were stuck, are on the workers' stderr above)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run_arm(strategy: Any, what: str, bound: float, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``strategy.run(fn, args)`` within ``bound`` seconds (+1 minute for the replicas' own timeouts to fire)."""
    start = time.monotonic()
    with bounded(what, bound + 60):
        try:
            return list(strategy.experimental_local_results(strategy.run(fn, args=args)))
        except Exception as e:
            raise SystemExit(f"{what} failed after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}") from e


def overhead_arm(arm: str, nbytes: int, calls: int) -> float:
    """On a replica: median seconds per all-reduce of ``nbytes`` (float32) through ``arm``."""
    import torch
    import torch.distributed as dist

    ctx = dd.get_replica_context()
    if arm == "torch" and not dist.is_initialized():
        dd.plugins.torch.init_process_group()
    tensor = torch.zeros(nbytes // 4)  # zeros: repeated sums stay finite
    array = tensor.numpy()
    times = []
    for _ in range(calls):
        ctx.barrier()
        start = time.perf_counter()
        if arm == "torch":
            dist.all_reduce(tensor)
        else:
            ctx.all_reduce("SUM", array)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(rounds: int, cnn_steps: int, mlp_steps: int, parts: str = "ddp,overhead", bound: float = 240.0,
         hosts: str = "local", rates: tuple[str, ...] = ("1gbit", "10gbit"), windows: tuple[int, ...] = (),
         per_host: int = 1) -> None:
    """Run the ``parts`` on one host (``hosts="local"``) or on two namespace hosts (``per_host`` replicas
    each) at each of ``rates``."""
    import dask

    if hosts == "local":
        print_header("DDP on daskdist vs DDP on gloo (2 replicas, one host), and the torch layer's cost per call")
    else:
        print_header(f"DDP on daskdist vs DDP on gloo across 2 network-namespace hosts "
                     f"({per_host} replica{'s' if per_host > 1 else ''} each), links {', '.join(rates)}")
    print(_torch_line(), flush=True)
    WINDOWS[:] = windows
    # daskdist's collectives get the arm's bound as their deadline too (gloo gets it in ddp_arm)
    with dask.config.set({"daskdist.collective.timeout": f"{bound:g}s"}):
        if hosts == "local":
            with local_cluster(2) as client, dd.MirroredStrategy(client=client) as strategy:
                _announce(client)
                run_parts(strategy, parts, rounds, cnn_steps, mlp_steps, bound)
            return
        with namespace_cluster(2, per_host, rate=rates[0]) as (netns, client), \
                dd.MultiWorkerMirroredStrategy(client=client) as strategy:
            _announce(client)
            _check_host_by_host(strategy, per_host, bound)
            ports = itertools.count(GLOO_PORT)
            where = "2 hosts" if per_host == 1 else f"2 x {per_host}"
            for rate in rates:
                netns.shape(rate)
                print(f"\n--- links shaped to {rate} (tc tbf on each host's eth0) ---", flush=True)
                run_parts(strategy, parts, rounds, cnn_steps, mlp_steps, bound, where=f"{where}, {rate}", ports=ports,
                          rate=rate, per_host=per_host)


def _host_name() -> str:
    import socket

    return socket.gethostname()


def _check_host_by_host(strategy: Any, per_host: int, bound: float) -> None:
    """End the benchmark unless rank r runs on host r // ``per_host`` (the gloo arm's ranks are the same)."""
    names = run_arm(strategy, "host names of the replicas", bound, _host_name)
    print(f"replicas' hosts by rank: {names}", flush=True)
    if any(names[r] != names[r - r % per_host] or (r >= per_host and names[r] == names[r - per_host])
           for r in range(len(names))):
        raise SystemExit(f"ranks are not ordered host by host ({per_host} a host): {names}")


def _announce(client: Any) -> None:
    """Print the replica processes (for py-spy) and the BLAS each loaded with torch (threadpoolctl)."""
    print(f"replica processes: {sorted(client.run(os.getpid).values())} (py-spy dump --pid ... if stuck)", flush=True)
    print(f"BLAS in the workers (threadpoolctl, torch imported): {sorted(set(client.run(_worker_blas).values()))}",
          flush=True)


def _worker_blas() -> str:
    import torch  # noqa: F401  (loads torch's BLAS next to numpy's)

    return blas_in_use()


def run_parts(strategy: Any, parts: str, rounds: int, cnn_steps: int, mlp_steps: int, bound: float,
              where: str = "one host", ports: Iterator[int] | None = None, rate: str | None = None,
              per_host: int = 1) -> None:
    """The DDP and per-call tables on ``strategy``'s replicas, then their torch groups destroyed."""
    if "ddp" in parts:
        ddp_figures(strategy, rounds, cnn_steps, mlp_steps, bound, where, ports, rate, per_host)
    if "overhead" in parts:
        overhead_figures(strategy, rounds, bound)
    run_arm(strategy, "destroying the torch groups", bound, dd.plugins.torch.destroy_process_group)


def ddp_figures(strategy: Any, rounds: int, cnn_steps: int, mlp_steps: int, bound: float, where: str = "one host",
                ports: Iterator[int] | None = None, rate: str | None = None, per_host: int = 1) -> None:
    """DDP on gloo and on daskdist, ``rounds`` rounds alternated: step times, samples/s, final losses.

    ``ports``: gloo's ``MASTER_PORT`` for each arm (``env://`` rendezvous across hosts); ``None``: through
    daskdist's store. ``where`` heads the table's rows. ``rate``: the hosts' link (tc's rate): adds the
    ``bound`` arm (``bound_arm``, ``per_host`` replicas a host: that many ports) to the rotation and its table.
    """
    rows, losses = [], {}
    results: dict[tuple[str, str], list[float]] = {}
    computes: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    others: dict[tuple[str, str], list[float]] = {}  # CPU per step off the replica thread (communication, Dask)
    loads: dict[tuple[str, str], list[float]] = {}
    import dask

    ours_arms = [f"daskdist w{w}" for w in WINDOWS] or ["daskdist"]
    arms = ["gloo", *ours_arms, *(["bound"] if rate is not None else [])]
    bounds: dict[str, list[dict[str, float]]] = {}  # model -> bound_figures per round
    for r in range(rounds):
        for name, steps in (("cnn", cnn_steps), ("mlp", mlp_steps), *EXTRA_MODELS):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotated round by round
                what = f"round {r + 1}, {name}, {arm}"
                loads.setdefault((name, arm), []).append(_load(f"{where}: {what}"))
                if arm == "bound":
                    first = [next(ports) for _ in range(per_host)][0] if ports is not None else None
                    out = run_arm(strategy, f"{where}: {what}", bound, bound_arm, name, steps, 3, first, per_host)
                    bounds.setdefault(name, []).append(bound_figures(out, _bits_per_second(rate or "")))
                    continue
                port = next(ports) if ports is not None and arm == "gloo" else None
                window: dict[str, Any] = {}
                if arm.startswith("daskdist w"):
                    window["daskdist.collective.async-window"] = int(arm[10:])
                    if int(arm[10:]) > 1:
                        window["daskdist.torch.comm-thread"] = True
                with dask.config.set(window):
                    out = run_arm(strategy, f"{where}: {what}", bound, ddp_arm, arm, name, steps, 3,
                                  f"{r}-{name}-{arm.replace(' ', '')}", bound, port)
                step = max(statistics.median(o["times"]) for o in out)  # the slowest replica's median
                results.setdefault((name, arm), []).append(step)
                computes.setdefault((name, arm), []).append(max(statistics.median(o["compute"]) for o in out))
                cpus.setdefault((name, arm), []).append(max(statistics.median(o["cpu"]) for o in out))
                others.setdefault((name, arm), []).append(max(statistics.median(o["others"]) for o in out))
                losses[(name, arm)] = out[0]["loss"]
    replicas = strategy.num_replicas_in_sync
    for name in ("cnn", "mlp", *(extra for extra, _ in EXTRA_MODELS)):
        for arm in ours_arms:
            gloo, ours = results[(name, "gloo")], results[(name, arm)]
            ratios = [g / d for g, d in zip(gloo, ours)]
            label = name if arm == "daskdist" else f"{name} ({arm})"
            rows.append([where, label, _ms(gloo), _ms(ours), _ms(computes[(name, "gloo")]),
                         _ms(computes[(name, arm)]), _ms(cpus[(name, "gloo")]), _ms(cpus[(name, arm)]),
                         f"{_ms(others[(name, 'gloo')])} / {_ms(others[(name, arm)])}",
                         f"{GLOBAL_BATCH / statistics.median(gloo):.0f}",
                         f"{GLOBAL_BATCH / statistics.median(ours):.0f}",
                         ", ".join(f"{x:.2f}" for x in ratios),
                         f"{losses[(name, 'gloo')]:.6f} / {losses[(name, arm)]:.6f}",
                         _loads(loads[(name, "gloo")]), _loads(loads[(name, arm)])])
    for name in ("cnn", "mlp", *(extra for extra, _ in EXTRA_MODELS)):
        for arm in ours_arms:
            print(_parity(name, arm, losses[(name, "gloo")], losses[(name, arm)], replicas), flush=True)
    print(format_table(["where", "model", "gloo step ms (rounds)", "daskdist step ms (rounds)",
                        "no_sync step ms gloo arm", "no_sync step ms daskdist arm", "CPU ms/step gloo",
                        "CPU ms/step daskdist", "of which off the replica thread gloo / daskdist", "gloo samples/s",
                        "daskdist samples/s", "daskdist/gloo", "final loss gloo / daskdist", "load gloo (rounds)",
                        "load daskdist (rounds)"], rows))
    print()
    if bounds:
        print_bounds(results, cpus, bounds, loads, where, ours_arms)


def _parity(name: str, arm: str, gloo: float, ours: float, replicas: int) -> str:
    """The parity check of the final losses: bit-equal with 2 replicas (one sum, either order the same), within
    ``LOSS_RTOL`` with more (gloo's ring and daskdist's hierarchy add in different orders)."""
    if replicas <= 2:
        return f"parity {name} ({arm}): losses bit-equal: {gloo == ours}"
    gap = abs(gloo - ours) / max(abs(gloo), 1e-30)
    return (f"parity {name} ({arm}): losses within {LOSS_RTOL:g} relative ({replicas} replicas: summation orders "
            f"differ): {gap <= LOSS_RTOL} (gap {gap:.2e}{', bit-equal' if gloo == ours else ''})")


def bound_figures(out: list[dict[str, Any]], bits_per_second: float) -> dict[str, float]:
    """The bound arm's replicas' figures: ``step`` (the bound), ``wall`` (its link floor), ``cpu`` (the
    kernel's floor), ``share`` (replicas per core used: a replica's CPU per step x ``share`` is its arm's CPU
    floor), ``bare`` (the bare step, no link), ``bare_cpu``, ``raw_cpu`` (CPU per step, each the
    slowest replica's median).

    ``wall``: the slowest replica's median of ``bound_steps``. ``cpu``: all replicas of both hosts share this
    machine's cores, so a step takes at least the CPU they spend on it over the cores: the sum over the
    replicas of the bare step plus a plain TCP exchange of the gradient (``raw_cpu``), over ``os.cpu_count()``
    cores, at most one per replica. ``step`` is the larger.
    """
    wall = max(statistics.median(bound_steps(o, bits_per_second)) for o in out)
    raw = [statistics.median(o["raw_cpu"]) for o in out if o["raw_cpu"]]
    cores = min(len(out), os.cpu_count() or 1)
    cpu = sum(raw) / cores if raw else 0.0
    return {"step": max(wall, cpu), "wall": wall, "cpu": cpu, "share": len(out) / cores, "bare": max(statistics.median(o["times"]) for o in out),
            "bare_cpu": max(statistics.median(o["cpu"]) for o in out), "raw_cpu": max(raw, default=0.0)}


def print_bounds(results: dict[tuple[str, str], list[float]], cpus: dict[tuple[str, str], list[float]],
                 bounds: dict[str, list[dict[str, float]]], loads: dict[tuple[str, str], list[float]], where: str,
                 ours_arms: list[str]) -> None:
    """Per model: gloo's and daskdist's steps, the bound arm's, and gloo / bound (the most any backend gains).

    Also gloo's CPU floor (its replica's CPU per step x replicas per core) over the bound's: where the steps
    are CPU-bound (all replicas on this machine's cores) that is the most any backend gains, and it holds under
    load, where the walls do not.
    """
    rows = []
    for name, per_round in bounds.items():
        gloo = results[(name, "gloo")]
        best = [g / b["step"] for g, b in zip(gloo, per_round)]
        rows.append([where, name, _ms(gloo), "; ".join(_ms(results[(name, arm)]) for arm in ours_arms),
                     _ms([b["step"] for b in per_round]), _ms([b["wall"] for b in per_round]),
                     _ms([b["cpu"] for b in per_round]), _ms([b["bare"] for b in per_round]),
                     _ms(cpus[(name, "gloo")]), "; ".join(_ms(cpus[(name, arm)]) for arm in ours_arms),
                     _ms([b["bare_cpu"] for b in per_round]), _ms([b["raw_cpu"] for b in per_round]),
                     ", ".join(f"{x:.2f}" for x in best), f"{statistics.median(best):.2f}",
                     ", ".join(f"{c * b['share'] / b['cpu']:.2f}" for c, b in zip(cpus[(name, "gloo")], per_round) if b["cpu"]),
                     _loads(loads[(name, "bound")])])
    print(format_table(["where", "model", "gloo step ms (rounds)", "daskdist step ms (rounds)", "bound step ms",
                        "link floor ms", "CPU floor ms", "bare step ms", "CPU ms/step gloo", "CPU ms/step daskdist",
                        "CPU ms/step bare", "CPU ms/step bare + raw TCP", "gloo / bound (rounds)", "median",
                        "gloo CPU / CPU floor", "load bound (rounds)"], rows))
    print()


def _ms(seconds: list[float]) -> str:
    return ", ".join(f"{1e3 * t:.1f}" for t in seconds)


def overhead_figures(strategy: Any, rounds: int, bound: float) -> None:
    """``dist.all_reduce`` against ``ReplicaContext.all_reduce``, 4 KiB and 64 MiB."""
    rows = []
    for nbytes, calls in ((4096, 2000), (64 << 20, 10)):
        per: dict[str, list[float]] = {"torch": [], "context": []}
        loads: dict[str, list[float]] = {"torch": [], "context": []}
        for r in range(rounds):
            for arm in (("torch", "context") if r % 2 == 0 else ("context", "torch")):
                what = f"round {r + 1}, {nbytes} bytes, {arm}"
                loads[arm].append(_load(what))
                out = run_arm(strategy, what, bound, overhead_arm, arm, nbytes, calls)
                per[arm].append(max(out))
        added = [t - c for t, c in zip(per["torch"], per["context"])]
        rows.append([f"{nbytes // 1024} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB",
                     ", ".join(f"{1e6 * t:.1f}" for t in per["context"]),
                     ", ".join(f"{1e6 * t:.1f}" for t in per["torch"]),
                     ", ".join(f"{1e6 * a:+.1f}" for a in added), _loads(loads["context"]), _loads(loads["torch"])])
    print(format_table(["size", "ReplicaContext.all_reduce us (rounds)", "dist.all_reduce us (rounds)",
                        "added by the torch layer us", "load context (rounds)", "load torch (rounds)"], rows))


def _torch_line() -> str:
    """torch's version and its BLAS (both arms run the same torch, one thread per replica)."""
    import torch

    blas = re.findall(r"(?:BLAS|LAPACK)_INFO=\w+", torch.__config__.show())
    return f"torch {torch.__version__}  {' '.join(blas) or 'BLAS: not reported'}  torch.set_num_threads(1) per replica"


def _load(what: str) -> float:
    """Print and return the 1-minute load average before an arm (figures under load must say so)."""
    load = os.getloadavg()
    print(f"load before {what}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    return load[0]


def _loads(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cnn-steps", type=int, default=40)
    parser.add_argument("--mlp-steps", type=int, default=12)
    parser.add_argument("--resnet-steps", type=int, default=0,
                        help="also ResNet-18 (32x32 inputs) for this many steps per arm (default 0: not measured)")
    parser.add_argument("--parts", default=None,
                        help="comma-separated: ddp, overhead (default: both on one host, ddp across hosts)")
    parser.add_argument("--per-call-only", action="store_true", help="only the per-call part (--parts overhead)")
    parser.add_argument("--arm-timeout", type=float, default=240.0,
                        help="seconds an arm may take before its collectives and store time out (default 240)")
    parser.add_argument("--hosts", choices=["local", "netns"], default="local",
                        help="local: 2 worker processes of one host; netns: 2 network-namespace hosts (needs root)")
    parser.add_argument("--rates", default="1gbit,10gbit",
                        help="with --hosts netns: comma-separated link rates, measured in this order")
    parser.add_argument("--per-host", type=int, default=1,
                        help="with --hosts netns: replicas (single-threaded Dask workers) per host (default 1)")
    parser.add_argument("--windows", default="",
                        help="comma-separated daskdist.collective.async-window values: one daskdist arm each "
                             "(default: one arm with the configured window)")
    args = parser.parse_args()
    if args.per_host < 1 or (args.per_host > 1 and args.hosts != "netns"):
        parser.error("--per-host takes a count >= 1, above 1 only with --hosts netns")
    if args.resnet_steps:
        EXTRA_MODELS.append(("resnet18", args.resnet_steps))
    parts = "overhead" if args.per_call_only else args.parts or ("ddp,overhead" if args.hosts == "local" else "ddp")
    main(args.rounds, args.cnn_steps, args.mlp_steps, parts, args.arm_timeout, args.hosts,
         tuple(r.strip() for r in args.rates.split(",") if r.strip()),
         tuple(int(w) for w in args.windows.split(",") if w.strip()), args.per_host)
