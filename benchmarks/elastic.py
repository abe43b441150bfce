"""Elastic training: the cost of committing every step, and the time from a kill -9 to training again.

Two parts:

1. **Commit cost.** ``fit`` of the tutorial's CNN (``examples/mnist_mirrored.py``,
   MNIST-shaped synthetic data, ``map(scale).cache().batch(B)``: the tutorial's
   pipeline without its shuffle, so that plain and elastic read the same input:
   elastic ``fit`` turns a shuffle into a seeded full permutation planned each
   epoch, a plain strategy into per-replica buffers) on 2
   replicas, epochs alternating (ABBA) between a plain strategy and elastic ones
   with ``commit_every`` 1 and 10. Reported: median wall time per step of each
   (epoch time / steps, the warm-up epoch skipped), and the elastic ones'
   overhead against the plain one (goal: under 3 % at ``commit_every=1``).
2. **Recovery.** 3 ``dask worker`` processes (each with its nanny); one is
   killed with its nanny (SIGKILL) mid-epoch. Reported, per trial: seconds from
   the kill to the recovery event (new generation, commit restored), and to the
   first step of the new generation (replica 0's first progress event after it).
3. **Stopped.** The same with SIGSTOP instead of SIGKILL: the processes live and
   keep their sockets open but answer nothing; the scheduler declares the worker
   lost when its heartbeats stop for ``daskdist.elastic.heartbeat-timeout``.

Run: ``python benchmarks/elastic.py [--epochs 6] [--steps 32] [--trials 3] [--parts commit,recovery,stop]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cloudpickle  # noqa: E402
from _common import format_table, local_cluster, print_header  # noqa: E402
from training_parts import keras_parts  # noqa: E402
from training_parts.keras_parts import build_cnn, scale  # noqa: E402

# the `dask worker` processes of the kill trials do not have benchmarks/ on their path: ship `scale` by value
cloudpickle.register_pickle_by_value(keras_parts)

import daskdist as dd  # noqa: E402
from daskdist.elastic.recovery import ELASTIC_TOPIC  # noqa: E402
from daskdist.keras.models import PROGRESS_TOPIC  # noqa: E402

BATCH = 64


def dataset(steps: int):
    rng = np.random.default_rng(0)
    rows = steps * BATCH
    images = rng.integers(0, 256, (rows, 28, 28, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, rows).astype(np.int64)
    return dd.data.Dataset.from_tensor_slices((images, labels)).map(scale).cache().batch(BATCH)


def commit_cost(epochs: int, steps: int) -> None:
    kinds = {"plain": None, "commit_every=1": dd.ElasticOptions(1, commit_every=1),
             "commit_every=10": dd.ElasticOptions(1, commit_every=10)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    train = dataset(steps)
    with local_cluster(2) as client:
        strategies = {k: dd.MirroredStrategy(client=client, elastic=o) for k, o in kinds.items()}
        models = {}
        for name, strategy in strategies.items():
            with strategy.scope():
                models[name] = build_cnn()
            models[name].fit(train, epochs=1, verbose=0)  # warm-up
        order = list(kinds)
        for epoch in range(epochs):
            for name in (order if epoch % 2 == 0 else order[::-1]):
                start = time.perf_counter()
                models[name].fit(train, epochs=1, verbose=0)
                times[name].append((time.perf_counter() - start) / steps)
        for strategy in strategies.values():
            strategy.close()
    plain = statistics.median(times["plain"])
    rows = [[name, f"{statistics.median(t) * 1e3:.2f}", f"{(statistics.median(t) / plain - 1) * 100:+.1f} %"]
            for name, t in times.items()]
    print(format_table(["strategy", "ms per step (median)", "vs plain"], rows))


def _kill_mid_epoch(client, step: int, pids: tuple[int, ...], killed: dict, how: int = signal.SIGKILL) -> None:
    """Send ``how`` to ``pids`` once replica 0 reported ``step``; the kill's time goes in ``killed["at"]``."""
    since = time.time()
    while not any(t > since and m.get("step", -1) >= step for t, m in client.get_events(PROGRESS_TOPIC)):
        time.sleep(0.01)
    killed["at"] = time.time()
    for pid in pids:
        os.kill(pid, how)


def recovery(trials: int, steps: int, how: int = signal.SIGKILL) -> None:
    from distributed import Client, LocalCluster

    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    results = []
    for _ in range(trials):
        cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=40)
        client = Client(cluster, set_as_default=False)
        nannies = [subprocess.Popen([dask, "worker", cluster.scheduler_address, "--nthreads", "1",
                                     "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for _ in range(3)]
        try:
            client.wait_for_workers(3, timeout=120)
            with dd.MirroredStrategy(client=client, elastic=dd.ElasticOptions(min_replicas=2)) as strategy:
                with strategy.scope():
                    model = build_cnn()
                victim = strategy.extended.worker_addresses[1]
                worker, nanny = client.run(lambda: (os.getpid(), os.getppid()), workers=[victim])[victim]
                killed: dict[str, float] = {}
                thread = threading.Thread(target=_kill_mid_epoch,
                                          args=(client, steps // 2, (nanny, worker), killed, how), daemon=True)
                thread.start()
                model.fit(dataset(steps), epochs=2, verbose=0)
                thread.join(10)
                restored = min(t for t, m in client.get_events(ELASTIC_TOPIC) if m.get("action") == "restored")
                first = min(t for t, m in client.get_events(PROGRESS_TOPIC) if t > restored)
                results.append((restored - killed["at"], first - killed["at"]))
                if how != signal.SIGKILL:
                    for pid in (nanny, worker):  # stopped, not dead: end them
                        os.kill(pid, signal.SIGKILL)
        finally:
            client.close()
            cluster.close()
            for process in nannies:
                process.kill()
                process.wait(10)
    rows = [[str(i), f"{r:.2f}", f"{f:.2f}"] for i, (r, f) in enumerate(results)]
    print(format_table(["trial", "kill -> restored (s)", "kill -> first step after (s)"], rows))
    print("(the first step is seen through replica 0's progress events, sent at most every 0.25 s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6, help="measured epochs per strategy (commit cost)")
    parser.add_argument("--steps", type=int, default=32, help="steps per epoch")
    parser.add_argument("--trials", type=int, default=3, help="kills (recovery)")
    parser.add_argument("--parts", default="commit,recovery,stop",
                        help="which parts, comma-separated: commit, recovery (kill -9), stop (SIGSTOP)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print_header("Elastic training")
    if "commit" in parts:
        print("\n## Commit cost\n")
        commit_cost(args.epochs, args.steps)
    if "recovery" in parts:
        print("\n## Recovery after kill -9 of a worker and its nanny\n")
        recovery(args.trials, args.steps)
    if "stop" in parts:
        print("\n## Recovery after SIGSTOP of a worker and its nanny (alive, silent)\n")
        recovery(args.trials, args.steps, signal.SIGSTOP)


if __name__ == "__main__":
    main()
