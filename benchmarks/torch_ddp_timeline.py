"""Where a DDP step's time goes across hosts, daskdist vs gloo: bucket timelines and bytes on the wire.

The same two network-namespace hosts, models and arms as ``torch_ddp.py
--hosts netns``. Per arm, on each replica: DDP with a comm hook that does what
DDP's default hook does (an async all-reduce of the bucket, then divide by the
world size) and records, per step, when each bucket was ready (the hook's
call, during backward), when its all-reduce was issued and when its future
completed, relative to the step's start; backward's end and the step's end;
and the bytes this host's ``eth0`` sent and received per step
(``/proc/self/net/dev`` inside the namespace: every byte on the wire, TCP/IP
headers and ACKs included), and the process's minor page faults per step.

    python benchmarks/torch_ddp_timeline.py --rates 1gbit --models mlp --steps 8 --rounds 2 \
        [--arms gloo,daskdist:8MiB/1/1MiB,daskdist:8MiB/4/1MiB]

An arm ``daskdist:<max>/<pieces>/<min>`` sets the pipelined ring's piece rule
on the replicas first (``collective.pipeline-bytes``, ``-pieces``,
``-min-bytes``), so piece rules compare in one sitting.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dask.utils import parse_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import daskdist as dd  # noqa: E402
from benchmarks._common import namespace_cluster, print_header  # noqa: E402
from benchmarks.torch_ddp import GLOBAL_BATCH, GLOO_PORT, _batch, _model  # noqa: E402


def _net_bytes() -> tuple[int, int]:
    """(rx, tx) bytes of this namespace's eth0."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            if line.strip().startswith("eth0:"):
                fields = line.split(":", 1)[1].split()
                return int(fields[0]), int(fields[8])
    return 0, 0


def set_pieces(spec: str) -> str:
    """On a replica: the pipelined ring's piece rule in this generation's engines, ``max/pieces/min`` (what
    ``collective.pipeline-bytes``, ``-pieces`` and ``-min-bytes`` set when the group is made); the previous one."""
    from daskdist.collective.core.engines.pipeline import PieceSize
    from daskdist.collective.core.engines.ring import RingEngine

    before = ""
    most, pieces, least = spec.split("/")
    for engine in dd.context.current_runtime().communicator.packed.engines:
        if isinstance(engine, RingEngine) and engine.pieces is not None:
            before = repr(engine.pieces)
            engine.pieces = PieceSize(parse_bytes(most), int(pieces), parse_bytes(least))
    return before


def timeline_arm(arm: str, name: str, steps: int, warmup: int, master_port: int | None, bound: float) -> dict[str, Any]:
    """On a replica: DDP steps of ``name`` on ``arm`` with a timing comm hook; per-step events and wire bytes."""
    import datetime
    from urllib.parse import urlsplit

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from daskdist import context

    torch.set_num_threads(1)
    runtime = context.current_runtime()
    timeout = datetime.timedelta(seconds=bound)
    if arm == "gloo":
        os.environ.update(MASTER_ADDR=urlsplit(runtime.spec.addresses[0]).hostname or "",
                          MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME="eth0")
        dist.init_process_group("gloo", init_method="env://", rank=runtime.rank, world_size=runtime.size,
                                timeout=timeout)
    else:
        dd.plugins.torch.init_process_group(timeout=timeout)
    model: Any = None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DistributedDataParallel(_model(name))
        events: list[tuple[str, int, int, float]] = []  # (what, bucket, bytes, time)
        t0 = [0.0]

        def hook(_state: Any, bucket: Any) -> Any:
            buf = bucket.buffer()
            index, nbytes = bucket.index(), buf.numel() * buf.element_size()
            events.append(("ready", index, nbytes, time.perf_counter() - t0[0]))
            fut = dist.all_reduce(buf, async_op=True).get_future()

            def done(f: Any) -> Any:
                events.append(("done", index, nbytes, time.perf_counter() - t0[0]))
                return f.value()[0].div_(world)

            return fut.then(done)

        hook.__annotations__.clear()  # DDP checks them, and ``from __future__ import annotations`` makes strings
        model.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        local = GLOBAL_BATCH // world
        per_step = []
        for s in range(steps + warmup):
            x, y = _batch(name, s)
            xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
            events.clear()
            rx0, tx0 = _net_bytes()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0[0] = start = time.perf_counter()
            optimizer.zero_grad()
            out = torch.nn.functional.cross_entropy(model(xs), ys)
            forward = time.perf_counter() - start
            out.backward()
            backward = time.perf_counter() - start
            optimizer.step()
            total = time.perf_counter() - start
            rx1, tx1 = _net_bytes()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
            if s >= warmup:
                per_step.append({"forward": forward, "backward": backward, "total": total, "events": list(events),
                                 "rx": rx1 - rx0, "tx": tx1 - tx0, "faults": faults})
        return {"rank": rank, "steps": per_step}
    finally:
        model = None
        if arm == "gloo":
            dist.destroy_process_group()
        else:
            dd.plugins.torch.destroy_process_group()


def show(arm: str, out: list[dict[str, Any]]) -> float:
    """Print one arm's per-step timeline (rank 0's median step, both ranks' bytes); the slower replica's median."""
    medians = []
    for replica in out:
        steps = replica["steps"]
        med = statistics.median(s["total"] for s in steps)
        medians.append(med)
        typical = min(steps, key=lambda s: abs(s["total"] - med))
        marks = ", ".join(f"{what} b{b} ({nb / 1e6:.1f} MB) {1e3 * t:.1f}" for what, b, nb, t in typical["events"])
        print(f"  {arm} rank {replica['rank']}: step median {1e3 * med:.1f} ms; typical step: forward "
              f"{1e3 * typical['forward']:.1f}, backward end {1e3 * typical['backward']:.1f}, {marks}, "
              f"end {1e3 * typical['total']:.1f} ms; eth0 per step tx "
              f"{statistics.median(s['tx'] for s in steps) / 1e6:.2f} MB, rx "
              f"{statistics.median(s['rx'] for s in steps) / 1e6:.2f} MB; minor page faults per step "
              f"{statistics.median(s['faults'] for s in steps):.0f}", flush=True)
    return max(medians)


def main(rates: list[str], models: list[str], steps: int, rounds: int, arms: list[str]) -> None:
    print_header(f"DDP bucket timelines across 2 namespace hosts, links {', '.join(rates)}")
    ports = itertools.count(GLOO_PORT + 100)
    with namespace_cluster(2, 1, rate=rates[0]) as (netns, client), \
            dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        for rate in rates:
            netns.shape(rate)
            for name in models:
                results: dict[str, list[float]] = {a: [] for a in arms}
                for r in range(rounds):
                    for arm in (arms if r % 2 == 0 else arms[::-1]):
                        load = os.getloadavg()
                        print(f"{rate} {name} round {r + 1} {arm} (load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})",
                              flush=True)
                        port = next(ports) if arm == "gloo" else None
                        if arm.startswith("daskdist:"):
                            strategy.run(set_pieces, args=(arm.split(":", 1)[1],))
                        out = list(strategy.experimental_local_results(
                            strategy.run(timeline_arm, args=(arm, name, steps, 2, port, 240.0))))
                        results[arm].append(show(arm, out))
                print(f"{rate} {name}: " + "; ".join(f"{a} {', '.join(f'{1e3 * t:.1f}' for t in v)} ms"
                                                    for a, v in results.items()), flush=True)
        strategy.run(dd.plugins.torch.destroy_process_group)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="1gbit")
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", default="gloo,daskdist")
    args = parser.parse_args()
    main(args.rates.split(","), args.models.split(","), args.steps, args.rounds, args.arms.split(","))
