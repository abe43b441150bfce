"""Training: framework overhead per step, scaling of ``fit``, and PyTorch through daskdist vs DDP.

One invocation measures three things (each part starts its own local cluster
and closes it before the next):

1. **Overhead per step** of ``model.fit`` with 2 replicas
   (``dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])``, embedded cluster) for
   the tutorial's CNN (``examples/mnist_mirrored.py``) on MNIST-shaped synthetic
   data, through the tutorial's input pipeline. Per step, from
   ``strategy.step_timings()``: total, input_wait, allreduce, apply, compute
   (the warm-up epoch skipped). Before the first measured epoch and after each
   one, on the same replicas (``strategy.run``, so BLAS threading is the one
   ``fit`` has), a block of plain steps of the same model's math at the same
   per-replica batch (forward through ``model.layers``,
   ``loss.per_example``/``loss.gradient``, backward, ``optimizer.apply``, metric
   update: the calls ``daskdist/keras/training.py`` makes, without the
   framework), and a control block of the same loop plus ``fit``'s all-reduce
   call, which synchronises the replicas every step as ``fit`` does. Epochs are
   short (16 steps by default, 20 of them) so that fit epochs and plain blocks
   alternate every second or two on this noisy machine.
   Overhead = median fit step total - median bare step - median allreduce -
   median input_wait (goal: under 1 ms); also reported: fit step - input_wait -
   control step, and the CPU time of the worker processes per step.
2. **Scaling of the built-in layers**: samples/s of ``fit`` (the same CNN and
   pipeline, same global data, per-replica batch 64) with 1 replica
   (``devices=["/cpu:0"]``) and 2 replicas, both strategies on one 2-worker
   cluster, epochs alternating between them (ABBA) after one warm-up epoch each.
   Ratio 2-replica / 1-replica samples/s (limit 2x, aim 1.8x).
3. **PyTorch**: the same CNN in PyTorch, trained (a) through daskdist's plug-in
   path (``dd.plugins.torch.allreduce_gradients`` inside ``strategy.run``, loop in
   the replicas over a distributed dataset, as ``examples/pytorch_plugin.py``)
   and (b) with ``DistributedDataParallel`` over gloo (``torch.multiprocessing``
   spawn, ``tcp://127.0.0.1:<free port>``), 2 and 1 processes/replicas, same
   data split, batch and steps, ``torch.set_num_threads(1)`` everywhere. The
   daskdist cluster is closed while DDP runs; rounds rotate the order.
   Reported: samples/s, daskdist/DDP at 2 replicas (goal >= 1.0), and each one's
   scaling efficiency (2-replica samples/s / (2 x 1-replica samples/s)); per step
   also the training thread's user and system CPU time and minor page faults
   (the slowest rank's, ``RUSAGE_THREAD``).

   Allocator: replicas set glibc's ``malloc`` options when they start
   (``daskdist.replica.malloc``, ``daskdist/replica/allocator.py``); the DDP ranks
   set the same (``dd.plugins.torch.set_malloc_options``), so
   that neither side depends on what its process happened to allocate first.
   Without them (measured before daskdist set them) a replica faulted in
   2,000-10,000 pages and spent 4-12 ms of system time per step; a DDP rank,
   whose process makes its data and so had already pushed glibc's adaptive
   thresholds up, about 100 pages and 2 ms (see the faults column).

   DDP runs with the environment this script started with (what a standalone
   DDP job gets). The clusters are started as daskdist's embedded cluster
   starts its workers: without Dask's ``MALLOC_TRIM_THRESHOLD_=65536``
   (``daskdist.embedded.malloc-trim-threshold``), which makes glibc map and
   unmap every large temporary array. When the workers' variables differ from
   DDP's (``--worker-malloc-trim dask`` gives them Dask's default), DDP is also
   run a second time with the workers' variables ("DDP, worker env"), which
   separates the allocator setting from the rest of the framework
   (``--no-ddp-worker-env`` skips it).

Usage::

    .venv/bin/python benchmarks/training.py            # 7 to 11 minutes on 2 busy cores
    .venv/bin/python benchmarks/training.py --quick    # about 2 minutes
    .venv/bin/python benchmarks/training.py --parts 1 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from _common import check_worker_settings, format_table, print_header, settings_line

CPU = ["/cpu:0", "/cpu:1"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {message}", flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def med(values: Any) -> float:
    return float(np.median(np.asarray(values, dtype=float)))


@contextlib.contextmanager
def quiet_cluster_logs() -> Iterator[None]:
    """Silence ``distributed``'s INFO chatter (cluster start/stop) without hiding warnings or errors."""
    names = ["distributed", "daskdist"]
    previous = [logging.getLogger(n).level for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for n, level in zip(names, previous):
            logging.getLogger(n).setLevel(level)


# -- part 1: overhead per step --------------------------------------------------------------------------


BARE = "bare"
BARE_AR = "bare + all-reduce"


def part1(args: argparse.Namespace) -> dict:
    from training_parts import keras_parts as kp

    import daskdist as dd

    batch = args.batch_per_replica
    samples = args.overhead_samples
    steps = samples // (2 * batch)
    images, labels = kp.synthetic_mnist(samples)
    load = [os.getloadavg()[0]]
    log(f"part 1: 2 replicas, {samples} samples, per-replica batch {batch}, {steps} steps/epoch, "
        f"{args.warmup_epochs} warm-up + {args.overhead_epochs} measured epochs; after the warm-up and after each "
        f"measured epoch one block of {steps} plain steps without and one with the all-reduce (order alternating)")
    fit_steps: list[list[dict]] = []
    blocks: dict[str, list[np.ndarray]] = {BARE: [], BARE_AR: []}
    fit_cpu: list[float] = []  # per measured epoch: worker-process CPU seconds per replica-step
    with dd.MirroredStrategy(devices=CPU) as strategy:
        check_worker_settings(strategy.client)
        worker_environment = seen_by_workers(strategy.client)
        log(f"  worker environment: {worker_environment}")
        x, y = kp.persist_on_cluster(strategy.client, images, labels)
        dataset = kp.tutorial_pipeline(x, y, batch * strategy.num_replicas_in_sync)
        with strategy.scope():
            model = kp.build_cnn()

        cpu_mark: list[float] = []

        def worker_cpu() -> float:
            return sum(strategy.client.run(kp.process_cpu_seconds).values())

        def before_epoch(epoch: int) -> None:
            if epoch >= args.warmup_epochs:
                cpu_mark[:] = [worker_cpu()]

        def after_epoch(epoch: int, wall_start: float) -> None:
            if epoch + 1 < args.warmup_epochs:
                return
            text = ""
            if epoch >= args.warmup_epochs:
                fit_cpu.append((worker_cpu() - cpu_mark[0]) / (2 * steps))
                rows = [s for replica in strategy.step_timings() for s in replica if s["start"] >= wall_start]
                if len(rows) != 2 * steps:
                    raise RuntimeError(f"expected {2 * steps} step timings for epoch {epoch}, got {len(rows)}")
                fit_steps.append(rows)
                text = f"fit step median {ms(med([r['total'] for r in rows]))} ms; "
            order = [BARE, BARE_AR] if epoch % 2 == 0 else [BARE_AR, BARE]
            for kind in order:
                result = strategy.run(kp.bare_block, args=(batch, steps, args.bare_warmup, epoch, kind == BARE_AR))
                blocks[kind].append(np.concatenate(strategy.experimental_local_results(result)))
            load.append(os.getloadavg()[0])
            log(f"  epoch {epoch}: {text}step median {BARE} {ms(med(blocks[BARE][-1][:, 0]))} ms, "
                f"{BARE_AR} {ms(med(blocks[BARE_AR][-1][:, 0]))} ms")

        timer = kp.EpochTimer(after_epoch=after_epoch, before_epoch=before_epoch)
        model.fit(dataset, epochs=args.warmup_epochs + args.overhead_epochs, verbose=0, callbacks=[timer])
    load.append(os.getloadavg()[0])

    def phase(key: str) -> np.ndarray:
        return np.array([r[key] for rows in fit_steps for r in rows])

    total, wait, allreduce, apply_, compute = (phase(k) for k in ("total", "input_wait", "allreduce", "apply",
                                                                     "compute"))
    bare: dict[str, dict] = {}
    for kind, kind_blocks in blocks.items():
        every = np.concatenate(kind_blocks)
        bare[kind] = {"step": med(every[:, 0]), "math": med(every[:, 1]), "apply": med(every[:, 2]),
                      "allreduce": med(every[:, 4]), "p90_step": float(np.percentile(every[:, 0], 90)),
                      "steps": len(every), "blocks": len(kind_blocks),
                      "cpu": med([np.mean(b[:, 3]) for b in kind_blocks])}  # per block: CPU s per replica-step
    overhead = med(total) - bare[BARE]["step"] - med(allreduce) - med(wait)
    per_epoch: dict[str, list[float]] = {BARE: [], BARE_AR: []}  # each epoch against the blocks around it
    for i, rows in enumerate(fit_steps):
        fit_total, fit_wait = med([r["total"] for r in rows]), med([r["input_wait"] for r in rows])
        fit_reduce = med([r["allreduce"] for r in rows])
        around = {k: 0.5 * (med(blocks[k][i][:, 0]) + med(blocks[k][i + 1][:, 0])) for k in blocks}
        per_epoch[BARE].append(fit_total - around[BARE] - fit_reduce - fit_wait)
        per_epoch[BARE_AR].append(fit_total - around[BARE_AR] - fit_wait)
    return {
        "samples": samples, "batch": batch, "steps": steps, "epochs": len(fit_steps),
        "fit": {"total": med(total), "input_wait": med(wait), "allreduce": med(allreduce), "apply": med(apply_),
                "compute": med(compute), "p90_total": float(np.percentile(total, 90)),
                "nbytes": fit_steps[0][0]["nbytes"], "collectives": fit_steps[0][0]["collectives"],
                "cpu": med(fit_cpu)},
        "bare": bare,
        "overhead": overhead,
        "overhead_per_step": med(total - wait - allreduce) - bare[BARE]["step"],
        "overhead_vs_bare_ar": med(total - wait) - bare[BARE_AR]["step"],
        "overhead_per_epoch": per_epoch,
        "overhead_per_epoch_median": {k: med(v) for k, v in per_epoch.items()},
        "cpu_overhead": {k: med(fit_cpu) - bare[k]["cpu"] for k in bare},
        "epoch_seconds": timer.seconds[args.warmup_epochs:],
        "load": load,
        "worker_environment": worker_environment,
    }


def print_part1(r: dict) -> None:
    f, b, a = r["fit"], r["bare"][BARE], r["bare"][BARE_AR]
    print(f"\nPart 1: overhead per step, 2 replicas, tutorial CNN, per-replica batch {r['batch']}, "
          f"{r['samples']} samples ({r['steps']} steps/epoch), {r['epochs']} measured epochs "
          f"({2 * r['steps'] * r['epochs']} replica-steps of fit; {b['steps']} replica-steps of each plain loop in "
          f"{b['blocks']} blocks)")
    print(f"gradient all-reduce per step: {f['collectives']} collective(s), {f['nbytes']} bytes; "
          f"worker environment: {r['worker_environment']}")
    rows = [
        ["fit: step total", ms(f["total"]), f"p90 {ms(f['p90_total'])}"],
        ["fit: input_wait", ms(f["input_wait"]), ""],
        ["fit: allreduce", ms(f["allreduce"]), ""],
        ["fit: apply", ms(f["apply"]), "optimizer.apply + gradient scaling"],
        ["fit: compute", ms(f["compute"]), "total - input_wait - allreduce - apply"],
        [f"{BARE}: step", ms(b["step"]), f"p90 {ms(b['p90_step'])}"],
        [f"{BARE}: math (all but apply)", ms(b["math"]), "compare fit: compute"],
        [f"{BARE}: apply", ms(b["apply"]), "compare fit: apply"],
        [f"{BARE_AR}: step", ms(a["step"]), f"p90 {ms(a['p90_step'])}"],
        [f"{BARE_AR}: all-reduce", ms(a["allreduce"]), "compare fit: allreduce"],
        ["overhead = fit total - bare step - fit allreduce - fit input_wait", ms(r["overhead"]), "goal < 1 ms"],
        ["  same, per step: median(fit total - input_wait - allreduce) - bare step", ms(r["overhead_per_step"]),
         ""],
        [f"  control: median(fit total - input_wait) - {BARE_AR} step", ms(r["overhead_vs_bare_ar"]),
         "both synchronise every step"],
    ]
    print(format_table(["quantity", "median ms", "note"], rows))
    for kind, values in r["overhead_per_epoch"].items():
        what = "total - bare - allreduce - input_wait" if kind == BARE else f"total - input_wait - {BARE_AR}"
        print(f"per measured epoch ({what}, against the mean of the blocks just before and after it), ms: "
              + ", ".join(f"{v * 1e3:.1f}" for v in values) + f"; median {ms(r['overhead_per_epoch_median'][kind])}")
    print(f"CPU time of the 2 worker processes (all threads) per replica-step (median over epochs/blocks of the "
          f"mean): fit {ms(f['cpu'])} ms (includes per-epoch work spread over {r['steps']} steps), "
          f"{BARE} {ms(b['cpu'])} ms, {BARE_AR} {ms(a['cpu'])} ms; fit minus these: "
          f"{ms(r['cpu_overhead'][BARE])} and {ms(r['cpu_overhead'][BARE_AR])} ms")
    print("load average (1 min) during part 1: " + ", ".join(f"{v:.2f}" for v in r["load"]))


# -- part 2: scaling of fit -----------------------------------------------------------------------------


def part2(args: argparse.Namespace) -> dict:
    from training_parts import keras_parts as kp

    import daskdist as dd

    batch = args.batch_per_replica
    samples = args.samples
    images, labels = kp.synthetic_mnist(samples)
    turns = kp.Turns(kp.abba("1", "2", args.warmup_epochs, args.epochs))
    log(f"part 2: 1 vs 2 replicas on one 2-worker cluster, {samples} samples, per-replica batch {batch}, "
        f"epoch order {' '.join(turns.schedule)} (first two are warm-ups)")
    load = [os.getloadavg()[0]]
    step_ms: dict[str, list[float]] = {"1": [], "2": []}
    with dd.MirroredStrategy(devices=CPU) as two:
        one = dd.MirroredStrategy(devices=CPU[:1], client=two.client)
        try:
            check_worker_settings(two.client)
            log(f"  worker environment: {seen_by_workers(two.client)}")
            x, y = kp.persist_on_cluster(two.client, images, labels)
            strategies = {"1": one, "2": two}
            models, datasets, timers = {}, {}, {}
            for name, strategy in strategies.items():
                datasets[name] = kp.tutorial_pipeline(x, y, batch * strategy.num_replicas_in_sync)
                with strategy.scope():
                    models[name] = kp.build_cnn()

            def recorder(name: str) -> Any:
                strategy = strategies[name]

                def after_epoch(epoch: int, wall_start: float) -> None:
                    rows = [s for rep in strategy.step_timings() for s in rep if s["start"] >= wall_start]
                    if epoch >= args.warmup_epochs:
                        step_ms[name].extend(r["total"] for r in rows)
                    log(f"  {name} replica(s), epoch {epoch}: {timers[name].seconds[-1]:.2f} s "
                        f"({samples / timers[name].seconds[-1]:.0f} samples/s)")
                return after_epoch

            for name in strategies:
                timers[name] = kp.EpochTimer(name, turns, after_epoch=recorder(name))
            errors: dict[str, BaseException] = {}

            def run(name: str) -> None:
                try:
                    models[name].fit(datasets[name], epochs=turns.count(name), verbose=0, callbacks=[timers[name]])
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors[name] = e
                    turns.fail(e)

            threads = [threading.Thread(target=run, args=(name,), name=f"fit-{name}") for name in strategies]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise next(iter(errors.values()))
        finally:
            one.close()
    load.append(os.getloadavg()[0])
    out: dict = {"samples": samples, "batch": batch, "order": turns.schedule, "load": load, "replicas": {}}
    for name in ("1", "2"):
        seconds = timers[name].seconds[args.warmup_epochs:]
        out["replicas"][int(name)] = {
            "global_batch": batch * int(name),
            "steps": samples // (batch * int(name)),
            "epoch_seconds": seconds,
            "samples_per_s": samples / med(seconds),
            "step_ms": med(step_ms[name]) * 1e3,
        }
    out["ratio"] = out["replicas"][2]["samples_per_s"] / out["replicas"][1]["samples_per_s"]
    out["efficiency"] = out["ratio"] / 2
    return out


def print_part2(r: dict) -> None:
    print(f"\nPart 2: scaling of fit (built-in layers), tutorial CNN and pipeline, {r['samples']} samples, "
          f"per-replica batch {r['batch']}; epoch order {' '.join(r['order'])} (warm-ups first)")
    rows = []
    for n, d in sorted(r["replicas"].items()):
        rows.append([n, d["global_batch"], d["steps"], len(d["epoch_seconds"]), f"{med(d['epoch_seconds']):.3f}",
                     f"{d['samples_per_s']:.1f}", f"{d['step_ms']:.3f}"])
    print(format_table(["replicas", "global batch", "steps/epoch", "epochs", "median epoch s", "samples/s",
                        "median step ms"], rows))
    for n, d in sorted(r["replicas"].items()):
        print(f"epoch seconds, {n} replica(s): " + ", ".join(f"{s:.2f}" for s in d["epoch_seconds"]))
    print(f"ratio 2 replicas / 1 replica: {r['ratio']:.3f}x (limit 2x, aim 1.8x); "
          f"scaling efficiency {r['efficiency']:.3f}")
    print("load average (1 min) at start / end of part 2: " + ", ".join(f"{v:.2f}" for v in r["load"]))


# -- part 3: PyTorch through daskdist vs DDP ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_daskdist(n: int, samples: int, batch: int, epochs: int) -> list[dict]:
    """One cluster, one ``strategy.run`` of ``epochs`` passes; per pass the slowest replica's figures."""
    import dask.array as da
    from training_parts import keras_parts as kp
    from training_parts import torch_parts as tp

    import daskdist as dd

    images, labels = tp.synthetic_nchw(samples)
    with dd.MirroredStrategy(devices=CPU[:n]) as strategy:
        seen = seen_by_workers(strategy.client)
        if seen != env_text(worker_env()):
            raise RuntimeError(f"the workers' environment is {seen}, expected {env_text(worker_env())}")
        chunk = samples // kp.PARTITIONS
        x, y = strategy.client.persist([da.from_array(images, chunks=(chunk, *images.shape[1:])),
                                        da.from_array(labels, chunks=chunk)])
        dist = strategy.experimental_distribute_dataset(dd.data.Dataset.from_dask((x, y)).batch(batch * n))
        result = strategy.run(tp.dd_train, args=(dist, epochs))
        per_replica = np.stack(strategy.experimental_local_results(result))
    return _slowest(per_replica)


def torch_ddp(n: int, samples: int, batch: int, epochs: int, env: dict[str, str | None]) -> list[dict]:
    """``n`` spawned DDP ranks, started with ``env`` (``None``: unset); per pass the slowest rank's figures."""
    import torch.multiprocessing as mp
    from training_parts import torch_parts as tp

    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as out, environment(env):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.spawn(tp.ddp_rank, args=(n, free_port(), samples, batch, epochs, out), nprocs=n, join=True)
        ranks = []
        for rank in range(n):
            with open(os.path.join(out, f"rank-{rank}.json")) as f:
                epochs_ = json.load(f)["epochs"]
            ranks.append([[e[f] for f in tp.FIELDS] for e in epochs_])
    return _slowest(np.array(ranks))


#: Environment variables that Dask's nanny sets for its workers (``distributed.nanny.pre-spawn-environ``)
#: and, as a side effect, in this process too (``os.environ.update`` before spawning).
ENV_KEYS = ("MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: Their values when this script started, before any cluster: what a standalone DDP job gets.
ORIGINAL_ENV = {k: os.environ.get(k) for k in ENV_KEYS}


def worker_env() -> dict[str, str | None]:
    """The values of ``ENV_KEYS`` that Dask workers started now get (``None``: unset)."""
    import dask
    import distributed  # noqa: F401  (registers the nanny defaults)

    from daskdist.cluster.embedded import worker_environment_config

    with dask.config.set(worker_environment_config()):  # what _common.local_cluster (and daskdist) start with
        cfg = dict(dask.config.get("distributed.nanny.pre-spawn-environ") or {})
    return {k: (None if cfg.get(k) is None else str(cfg[k])) for k in ENV_KEYS}


def seen_by_workers(client: Any) -> str:
    """The ``ENV_KEYS`` as the workers of ``client`` see them (checked to be the same on every worker)."""
    from training_parts import keras_parts as kp

    seen = list(client.run(kp.environment, ENV_KEYS).values())
    if any(s != seen[0] for s in seen):
        raise RuntimeError(f"workers differ in their environment: {seen}")
    return env_text(seen[0])


def env_text(env: dict[str, str | None]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items() if v is not None) or "(none set)"


@contextlib.contextmanager
def environment(env: dict[str, str | None]) -> Iterator[None]:
    """Set (or unset, for ``None``) environment variables for the duration; restore them after."""
    saved = {k: os.environ.get(k) for k in env}
    saved.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME"))
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _slowest(per_rank: np.ndarray) -> list[dict]:
    """``(ranks, epochs, FIELDS)`` -> per epoch the slowest rank's figures.

    Its seconds and steps, and per step: input and all-reduce ms, the training
    thread's user and system CPU ms, and its minor page faults.
    """
    out = []
    for e in range(per_rank.shape[1]):
        slowest = int(np.argmax(per_rank[:, e, 0]))
        seconds, steps, wait, reduce, user, sys_, minflt = per_rank[slowest, e]
        n = max(steps, 1)
        out.append({"seconds": float(seconds), "steps": int(steps), "input_ms": 1e3 * wait / n,
                    "allreduce_ms": 1e3 * reduce / n, "user_ms": 1e3 * user / n, "sys_ms": 1e3 * sys_ / n,
                    "minflt": minflt / n})
    return out


def part3(args: argparse.Namespace) -> dict:
    import torch

    batch = args.batch_per_replica
    samples = args.torch_samples
    epochs = 1 + args.torch_epochs
    workers = worker_env()
    systems: dict[str, Any] = {
        "daskdist": torch_daskdist,
        "DDP": lambda *a: torch_ddp(*a, env=dict(ORIGINAL_ENV)),
    }
    if args.ddp_worker_env and workers["MALLOC_TRIM_THRESHOLD_"] != ORIGINAL_ENV["MALLOC_TRIM_THRESHOLD_"]:
        systems["DDP, worker env"] = lambda *a: torch_ddp(*a, env=workers)
    log(f"part 3: PyTorch CNN, {samples} samples, per-replica batch {batch}, {args.rounds} round(s) of "
        f"1 warm-up + {args.torch_epochs} timed epochs per system and replica count; systems: {', '.join(systems)}")
    runs: dict[tuple[str, int], list[dict]] = {}
    load = [os.getloadavg()[0]]
    names = list(systems)
    for rnd in range(args.rounds):
        for i, n in enumerate((2, 1)):
            shift = (2 * rnd + i) % len(names)
            order = names[shift:] + names[:shift]
            for system in order:
                result = systems[system](n, samples, batch, epochs)[1:]
                runs.setdefault((system, n), []).extend(result)
                log(f"  round {rnd}, {system}, {n} replica(s): epochs "
                    + ", ".join(f"{e['seconds']:.2f} s" for e in result)
                    + f" ({samples / med([e['seconds'] for e in result]):.0f} samples/s)")
                load.append(os.getloadavg()[0])
    out: dict = {"samples": samples, "batch": batch, "rounds": args.rounds, "load": load, "torch": torch.__version__,
                 "env": {"daskdist": env_text(workers), "DDP": env_text(ORIGINAL_ENV),
                         "DDP, worker env": env_text(workers)},
                 "systems": {}}
    for (system, n), epochs_ in runs.items():
        seconds = [e["seconds"] for e in epochs_]
        out["systems"].setdefault(system, {})[n] = {
            "steps": epochs_[0]["steps"], "epochs": len(epochs_), "epoch_seconds": seconds,
            "samples_per_s": samples / med(seconds),
            "step_ms": 1e3 * med(seconds) / epochs_[0]["steps"],
            "input_ms": med([e["input_ms"] for e in epochs_]),
            "allreduce_ms": med([e["allreduce_ms"] for e in epochs_]),
            **{k: med([e[k] for e in epochs_]) for k in ("user_ms", "sys_ms", "minflt")},
        }
    for by_n in out["systems"].values():
        by_n["efficiency"] = by_n[2]["samples_per_s"] / (2 * by_n[1]["samples_per_s"])
    s = out["systems"]
    out["ratio"] = {other: {n: s["daskdist"][n]["samples_per_s"] / s[other][n]["samples_per_s"] for n in (1, 2)}
                    for other in s if other != "daskdist"}
    return out


def print_part3(r: dict, part2_result: dict | None) -> None:
    print(f"\nPart 3: PyTorch CNN (torch {r['torch']}), {r['samples']} samples, per-replica batch {r['batch']}, "
          f"{r['rounds']} round(s); epoch time = slowest rank's")
    systems = list(r["systems"])
    for system in systems:
        print(f"environment, {system}: {r['env'][system]}")
    rows = []
    for system in systems:
        for n in (1, 2):
            d = r["systems"][system][n]
            rows.append([system, n, d["steps"], d["epochs"], f"{med(d['epoch_seconds']):.3f}",
                         f"{d['samples_per_s']:.1f}", f"{d['step_ms']:.3f}", f"{d['input_ms']:.3f}",
                         f"{d['allreduce_ms']:.3f}" if system == "daskdist" else "(in backward)",
                         f"{d['user_ms']:.2f}", f"{d['sys_ms']:.2f}", f"{d['minflt']:.0f}"])
    print(format_table(["system", "replicas", "steps/replica/epoch", "epochs", "median epoch s", "samples/s",
                        "ms/step", "input ms/step", "all-reduce ms/step", "user ms/step", "sys ms/step",
                        "faults/step"], rows))
    for system in systems:
        for n in (1, 2):
            d = r["systems"][system][n]
            print(f"epoch seconds, {system}, {n} replica(s): " + ", ".join(f"{s:.2f}" for s in d["epoch_seconds"]))
    for other, ratio in r["ratio"].items():
        goal = " (goal >= 1.0)" if other == "DDP" else ""
        print(f"daskdist / {other} samples/s: 2 replicas {ratio[2]:.3f}{goal}, 1 replica {ratio[1]:.3f}")
    effs = [f"{system} {r['systems'][system]['efficiency']:.3f}" for system in systems]
    if part2_result is not None:
        effs.append(f"built-in layers (part 2) {part2_result['efficiency']:.3f}")
    print("scaling efficiency (2-replica samples/s / (2 x 1-replica samples/s)): " + ", ".join(effs))
    print("load average (1 min) during part 3: " + ", ".join(f"{v:.2f}" for v in r["load"]))


# -- summary ---------------------------------------------------------------------------------------------


def print_summary(results: dict) -> None:
    print("\nSummary")
    rows = []
    if "1" in results:
        r = results["1"]
        rows.append(["1. fit overhead per step beyond compute and all-reduce (2 replicas)",
                     f"{ms(r['overhead'])} ms", "< 1 ms", "met" if r["overhead"] < 1e-3 else "NOT met"])
        rows.append([f"1. control: fit step - input_wait - ({BARE_AR}) step", f"{ms(r['overhead_vs_bare_ar'])} ms",
                     "", ""])
    if "2" in results:
        r = results["2"]
        verdict = "aim met" if r["ratio"] >= 1.8 else ("NOT met (aim 1.8x)")
        rows.append(["2. fit samples/s, 2 replicas / 1 replica (built-in layers)", f"{r['ratio']:.3f}x",
                     "<= 2x, aim >= 1.8x", verdict])
        rows.append(["2. scaling efficiency, built-in layers", f"{r['efficiency']:.3f}", "", ""])
    if "3" in results:
        r = results["3"]
        for other, ratio in r["ratio"].items():
            goal = other == "DDP"
            rows.append([f"3. PyTorch samples/s, daskdist plug-in / {other}, 2 replicas", f"{ratio[2]:.3f}",
                         ">= 1.0" if goal else "", ("met" if ratio[2] >= 1.0 else "NOT met") if goal else ""])
            rows.append([f"3. PyTorch samples/s, daskdist plug-in / {other}, 1 replica", f"{ratio[1]:.3f}", "", ""])
        for system in r["systems"]:
            rows.append([f"3. scaling efficiency, {system}" + (" plug-in" if system == "daskdist" else ""),
                         f"{r['systems'][system]['efficiency']:.3f}", "", ""])
    print(format_table(["figure", "value", "goal", "verdict"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["1", "2", "3"], default=["1", "2", "3"])
    parser.add_argument("--overhead-samples", type=int, default=2_048,
                        help="part 1: synthetic MNIST-shaped samples per epoch (short epochs, so that fit epochs "
                             "and bare blocks alternate often; rounded down to a multiple of 8 x 2 x batch)")
    parser.add_argument("--overhead-epochs", type=int, default=20, help="part 1: measured epochs")
    parser.add_argument("--samples", type=int, default=6_144,
                        help="part 2: synthetic MNIST-shaped samples per epoch (same global data for 1 and 2 "
                             "replicas; rounded down to a multiple of 8 x 2 x batch)")
    parser.add_argument("--batch-per-replica", type=int, default=64)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=6, help="part 2: measured epochs per replica count")
    parser.add_argument("--bare-warmup", type=int, default=2, help="untimed steps at the start of each bare block")
    parser.add_argument("--torch-samples", type=int, default=4_096, help="samples per epoch in part 3")
    parser.add_argument("--torch-epochs", type=int, default=2, help="timed epochs per round in part 3")
    parser.add_argument("--rounds", type=int, default=2, help="rounds in part 3 (each system, 2 then 1 replica)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: part 1 6 epochs of 2048 samples, part 2 2 epochs of 4096, part 3 2048 "
                             "samples and 1 round")
    parser.add_argument("--no-ddp-worker-env", dest="ddp_worker_env", action="store_false",
                        help="part 3: skip the extra DDP run under the Dask workers' environment variables")
    parser.add_argument("--worker-malloc-trim", choices=["daskdist", "dask"], default="daskdist",
                        help="daskdist (default): workers get what daskdist's embedded cluster gives them "
                             "(daskdist.embedded.malloc-trim-threshold, default: unset); dask: Dask's nanny "
                             "default MALLOC_TRIM_THRESHOLD_=65536, for every cluster of this run")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.warmup_epochs < 1:
        parser.error("--warmup-epochs must be at least 1 (the first epoch fills the pipeline's cache)")
    if args.quick:
        args.overhead_samples, args.overhead_epochs = 2_048, 6
        args.samples, args.epochs = 4_096, 2
        args.torch_samples, args.torch_epochs, args.rounds = 2_048, 2, 1
    unit = 8 * 2 * args.batch_per_replica
    args.overhead_samples = max(unit, args.overhead_samples // unit * unit)
    args.samples = max(unit, args.samples // unit * unit)
    args.torch_samples = max(unit, args.torch_samples // unit * unit)

    print_header("Training benchmark: fit overhead per step, fit scaling 1 -> 2 replicas, PyTorch plug-in vs DDP")
    print(settings_line())
    if args.worker_malloc_trim == "dask":
        import dask

        dask.config.set({"daskdist.embedded.malloc-trim-threshold": 65536})
    print(f"Dask worker environment (distributed.nanny.pre-spawn-environ): {env_text(worker_env())}; "
          f"this process at start: {env_text(ORIGINAL_ENV)}")
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    started = time.perf_counter()
    results: dict = {}
    with quiet_cluster_logs():
        if "1" in args.parts:
            results["1"] = part1(args)
        if "2" in args.parts:
            results["2"] = part2(args)
        if "3" in args.parts:
            results["3"] = part3(args)
    print(f"\nfinished in {time.perf_counter() - started:.0f} s; load average at end: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if "1" in results:
        print_part1(results["1"])
    if "2" in results:
        print_part2(results["2"])
    if "3" in results:
        print_part3(results["3"], results.get("2"))
    print_summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    import warnings

    # the synthetic arrays go to the cluster inside the graph (da.from_array), once per cluster, untimed
    warnings.filterwarnings("ignore", message="Sending large graph")
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
