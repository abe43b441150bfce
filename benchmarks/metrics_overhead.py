"""Cost of daskdist's step metrics: timers plus shipping to the scheduler, versus timers only.

With ``daskdist.metrics.log-events: true`` (the default) every replica queues a
record of each step and ships the records to the scheduler as one Dask event
per ``metrics.event-interval``; the scheduler's metrics store feeds
``/metrics`` and the dashboard's ``/daskdist`` page. With it false the timings
stay on the replicas. The step timers themselves always run. Goal: shipping
adds < 2% to a training step.

One fresh ``LocalCluster`` of single-threaded worker processes (2 by default)
runs one strategy (one replica per worker) and the tutorial's model
(``examples/mnist_mirrored.py``: its CNN on scikit-learn's digits, 8x8, 16
examples per replica per step: the tutorial's shortest steps, so the largest
relative cost). Shipping is switched on and off on the same replicas, block by
block (the replica's ``log-events`` flag, which ``daskdist.metrics.log-events``
sets when the replica starts), in alternating order (on off, off on, ...), so
that both settings run on the same processes and noise on a shared machine hits
both alike.

Loops (``--loop``, all by default):

* ``replica``: the training loop inside the replicas, as ``fit`` runs it: each
  step the step ``fit`` makes (``daskdist.keras.training.train_step``:
  forward, loss gradient, backward, one fused gradient all-reduce, Adam update,
  on a batch held by the replica), wrapped in ``runtime.run_step`` (step timer
  plus shipping): the most direct end-to-end comparison, without client round
  trips. Replica 0's step times.
* ``run``: a custom training loop, one ``strategy.run`` per step (the same
  step), timed on the client.
* ``fit``: ``model.fit``, one epoch per block; per step: epoch wall time /
  steps. The script reports how many steps reached the scheduler's store:
  steps run by ``fit`` count only if the library ships them.
* ``cost`` (last: it floods the scheduler with records): the shipping cost
  itself, on replica 0: empty timed steps with shipping off and on (medians
  and means per round), as microseconds per step and as a share of the
  ``replica`` loop's step.

Reported per loop: median (and p90) step time of each setting, the ratio of the
medians on/off (1.00 = free), a 95% bootstrap interval of that ratio (resampling
whole rounds) and the median of the per-round ratios. ``--null`` runs the same
with log-events false everywhere (an A/A control: the method's own bias and
noise). ``--cheap-records`` is an experiment: it replaces
``StepTiming.to_dict`` on the workers by a direct dict of the same fields
(``dataclasses.asdict`` deep-copies every field, spans included, and is most of
the per-step cost), to see what that change would save.

Usage::

    .venv/bin/python benchmarks/metrics_overhead.py [--loop replica run fit cost] [--workers 2] [--null] [--cheap-records]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import numpy as np
from _common import (
    alternating_rounds,
    check_worker_settings,
    format_table,
    local_cluster,
    percentile_ms,
    print_header,
)

BATCH_PER_REPLICA = 16
GOAL = 1.02


# -- the tutorial's data and model ---------------------------------------------------------------


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as the tutorial loads them: (n, 8, 8, 1) float32 (0-16) and int64 labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = data.images.astype(np.float32)[..., None]
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    return images[order], labels[order]


def tutorial_cnn(strategy: Any) -> Any:
    from daskdist import keras

    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Conv2D(32, 3, activation="relu", input_shape=(8, 8, 1)),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def tutorial_dataset(client: Any, images: np.ndarray, labels: np.ndarray, global_batch: int, replicas: int) -> Any:
    """The tutorial's pipeline over Dask arrays persisted on the workers."""
    import dask.array as da

    import daskdist as dd

    chunk = max(1, len(labels) // (4 * replicas))
    x = client.persist(da.from_array(images, chunks=(chunk, 8, 8, 1)))
    y = client.persist(da.from_array(labels, chunks=chunk))

    def scale(image, label):
        return (image / 16.0).astype(np.float32), label

    return dd.data.Dataset.from_dask((x, y)).map(scale).cache().shuffle(10_000, seed=0).batch(global_batch)


# -- commands run on the replicas (``strategy.run``) ---------------------------------------------


def _hold_batch(images: np.ndarray, labels: np.ndarray) -> None:
    """Keep this replica's training batch on the replica (as a cache()d pipeline would)."""
    from daskdist import context

    context.current_runtime().objects.install("batch", "bench", ((images / 16.0).astype(np.float32), labels))


def _train_step(model_id: str) -> float:
    """One training step of the resident model on the resident batch: what ``fit`` does per step."""
    from daskdist import context
    from daskdist.keras import training
    from daskdist.strategy.drivers.contract import SpmdStepDriver

    runtime = context.current_runtime()
    trainable = runtime.objects.get("model", model_id)
    x, y = runtime.objects.get("batch", "bench")
    loss, _ = training.train_step(trainable, SpmdStepDriver(), x, y, None, runtime.timer)
    return loss


def _replica_loop(model_id: str, steps: int, ship: bool) -> np.ndarray:
    """``steps`` training steps in a loop on the replica (as ``fit`` runs them), each one timed step.

    Each step goes through ``runtime.run_step``, the wrapper every ``strategy.run`` step gets: step timer,
    and, when ``ship``, the step's record queued and sent to the scheduler once per ``metrics.event-interval``.
    ``ship`` switches this replica's ``log-events`` for the duration of the loop. Returns the seconds per step
    (an array: one leaf, so ``strategy.run`` gives a ``PerReplica`` of them).
    """
    from daskdist import context
    from daskdist.keras import training
    from daskdist.strategy.drivers.contract import SpmdStepDriver

    runtime = context.current_runtime()
    trainable = runtime.objects.get("model", model_id)
    x, y = runtime.objects.get("batch", "bench")
    step_args = (trainable, SpmdStepDriver(), x, y, None, runtime.timer)
    saved, runtime._log_events = runtime._log_events, ship
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            runtime.run_step(training.train_step, step_args, {})
            times.append(time.perf_counter() - start)
    finally:
        runtime._log_events = saved
    return np.array(times)


def _replica_cost(steps: int, rounds: int) -> np.ndarray:
    """Per round, the median and mean seconds of an empty timed step (``runtime.run_step``), shipping off and on.

    The difference is what shipping adds to every step: the step's record (``StepTiming.to_dict``)
    queued, and one Dask event per ``metrics.event-interval`` (the mean also catches rare costs, such as
    garbage collections). Returns an array of shape (rounds, 2, 2): round, (off, on), (median, mean).
    """
    from daskdist import context

    runtime = context.current_runtime()

    def empty() -> None:
        return None

    saved = runtime._log_events
    out = np.zeros((rounds, 2, 2))  # round, (off, on), (median, mean)
    try:
        for r in range(rounds):
            for column, ship in ((0, False), (1, True)) if r % 2 == 0 else ((1, True), (0, False)):
                runtime._log_events = ship
                times = np.empty(steps)
                for i in range(steps):
                    start = time.perf_counter()
                    runtime.run_step(empty, (), {})
                    times[i] = time.perf_counter() - start
                out[r, column] = np.median(times), np.mean(times)
    finally:
        runtime._log_events = saved
    return out


def _cheap_step_records() -> None:
    """``--cheap-records``: ``StepTiming.to_dict`` builds its dict directly instead of ``dataclasses.asdict``.

    An experiment, applied to the worker processes: ``asdict`` deep-copies every field, the spans too (which
    shipping then drops), and is most of what shipping costs per step. Same records, a fraction of the cost.
    """
    import dataclasses

    from daskdist.replica.timing import StepTiming

    names = [f.name for f in dataclasses.fields(StepTiming) if f.name != "spans"]

    def to_dict(self: Any, spans: bool = True) -> dict:
        out = {name: getattr(self, name) for name in names}
        if spans:
            out["spans"] = [list(span) for span in self.spans]
        return out

    StepTiming.to_dict = to_dict


def _flush() -> None:
    """Ship what this replica still holds (so that one loop's records do not land in the next one's steps)."""
    from daskdist import context

    runtime = context.current_runtime()
    if runtime._unsent_steps:
        runtime.flush_step_events()


def _store_steps(dask_scheduler: Any, group_id: str) -> int:
    """Steps of ``group_id`` the scheduler's metrics store has received (summed over replicas)."""
    plugin = dask_scheduler.extensions.get("daskdist")
    group = plugin.store.groups.get(group_id) if plugin is not None else None
    return 0 if group is None else sum(r.steps_total for r in group.replicas.values())


# -- timing ---------------------------------------------------------------------------------------


def _set_shipping(ship: bool) -> bool:
    """Switch this replica's ``log-events`` (what ``daskdist.metrics.log-events`` set when it started)."""
    from daskdist import context

    runtime = context.current_runtime()
    runtime._log_events = ship
    return runtime._log_events


class Bench:
    """The strategy, the tutorial's model on it, and the step times of each setting, block by block."""

    def __init__(self, client: Any, strategy: Any, null: bool):
        self.client = client
        self.strategy = strategy
        self.null = null
        self.model = tutorial_cnn(strategy)
        self.blocks: dict[str, list[list[float]]] = {"on": [], "off": []}

    def ship(self, name: str) -> bool:
        """Whether setting ``name`` ships (never with ``--null``)."""
        return name == "on" and not self.null

    def switch(self, name: str) -> None:
        """Set every replica's shipping for setting ``name`` (between blocks, untimed)."""
        seen = set(self.strategy.experimental_local_results(self.strategy.run(_set_shipping, args=(self.ship(name),))))
        if seen != {self.ship(name)}:
            raise RuntimeError(f"could not switch shipping to {self.ship(name)}: replicas report {seen}")

    def shipped_steps(self) -> int:
        return self.client.run_on_scheduler(_store_steps, group_id=self.strategy.extended.token)

    def drain(self) -> None:
        """Ship what the replicas still hold and let the scheduler take it."""
        self.switch("on")
        self.strategy.run(_flush)
        time.sleep(1.5)

    def abba(self, rounds: int, block: Any) -> None:
        """``rounds`` rounds of one block per setting, the order alternating (on off, off on, ...)."""
        self.blocks = alternating_rounds(["on", "off"], rounds, block)


def _hold_batches(strategy: Any, images: np.ndarray, labels: np.ndarray) -> None:
    import daskdist as dd

    n = strategy.num_replicas_in_sync
    b = BATCH_PER_REPLICA
    strategy.run(_hold_batch, args=(dd.PerReplica([images[i * b:(i + 1) * b] for i in range(n)]),
                                    dd.PerReplica([labels[i * b:(i + 1) * b] for i in range(n)])))


def _bootstrap_ratio(on: list[list[float]], off: list[list[float]], samples: int = 2000) -> tuple[float, float]:
    """95% interval of median(on)/median(off), resampling whole rounds (an on block with its off block)."""
    rng = np.random.default_rng(0)
    rounds = len(on)
    ratios = []
    for _ in range(samples):
        pick = rng.integers(0, rounds, rounds)
        a = np.concatenate([on[i] for i in pick])
        b = np.concatenate([off[i] for i in pick])
        ratios.append(np.median(a) / np.median(b))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def _report(title: str, bench: Bench, shipped: int) -> tuple[float, float]:
    """Print the table and the ratio; return (ratio on/off of the medians, median off step time in seconds)."""
    times = {name: [t for b in blocks for t in b] for name, blocks in bench.blocks.items()}
    rows = [[name, str(len(times[name])), f"{percentile_ms(times[name], 50):.3f}",
             f"{percentile_ms(times[name], 90):.3f}"] for name in ("on", "off")]
    print(title)
    print(format_table(["log-events", "samples", "median ms/step", "p90 ms/step"], rows))
    ratio = float(np.median(times["on"]) / np.median(times["off"]))
    low, high = _bootstrap_ratio(bench.blocks["on"], bench.blocks["off"])
    paired = float(np.median([np.median(a) / np.median(b) for a, b in zip(bench.blocks["on"], bench.blocks["off"])]))
    verdict = "met" if ratio < GOAL else "NOT met"
    print(f"step records that reached the scheduler's store: {shipped}")
    print(f"ratio on/off of the median step times: {ratio:.3f}  (95% bootstrap interval over rounds "
          f"{low:.3f}-{high:.3f}; median of the per-round ratios {paired:.3f}); goal < {GOAL:.2f}: {verdict}\n",
          flush=True)
    return ratio, float(np.median(times["off"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", nargs="+", choices=["replica", "run", "fit", "cost"],
                        default=["replica", "run", "fit", "cost"])
    parser.add_argument("--replica-steps", type=int, default=4000, help="replica loop: timed steps per setting")
    parser.add_argument("--replica-block", type=int, default=50, help="replica loop: steps per block")
    parser.add_argument("--steps", type=int, default=4000, help="run loop: timed steps per setting")
    parser.add_argument("--block", type=int, default=20, help="run loop: steps per block")
    parser.add_argument("--epochs", type=int, default=40, help="fit loop: timed epochs per setting")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (= replicas)")
    parser.add_argument("--null", action="store_true",
                        help="control run: shipping off in both settings (an A/A comparison)")
    parser.add_argument("--cheap-records", action="store_true",
                        help="experiment: patch StepTiming.to_dict on the workers to build its dict directly")
    args = parser.parse_args()

    import daskdist as dd

    print_header("training step time with step metrics shipped to the scheduler (on) vs kept on the replicas (off)")
    images, labels = digits()
    split = int(0.8 * len(labels))
    images, labels = images[:split], labels[:split]
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(local_cluster(args.workers))
        if args.cheap_records:
            client.run(_cheap_step_records)
            print("--cheap-records: StepTiming.to_dict patched on the workers (a direct dict, no dataclasses.asdict)")
        strategy = stack.enter_context(dd.MirroredStrategy(client=client))
        check_worker_settings(client)  # the workers see the client's daskdist settings (log-events: true)
        bench = Bench(client, strategy, args.null)
        if args.null:
            print("--null: shipping off in both settings: the ratio shows the method's own bias and noise")
        replicas = strategy.num_replicas_in_sync
        print(f"{replicas} replicas, per-replica batch {BATCH_PER_REPLICA}, the tutorial's CNN on digits 8x8\n")
        bench.model._ensure_installed()  # fit does this on first use
        _hold_batches(strategy, images, labels)
        model_id = bench.model._model_id

        typical_step = None
        if "replica" in args.loop:
            def replica_block(name: str) -> list[float]:  # one command: a loop of steps, shipping on or off
                per_replica = strategy.run(_replica_loop, args=(model_id, args.replica_block, bench.ship(name)))
                return strategy.experimental_local_results(per_replica)[0].tolist()  # replica 0's step times

            replica_block("off")  # warm-up
            bench.drain()
            before = bench.shipped_steps()
            bench.abba(max(2, args.replica_steps // args.replica_block), replica_block)
            bench.drain()
            _, step_s = _report(f"training loop inside the replicas, as fit runs it ({args.replica_block} steps per "
                                "block; replica 0's step times)", bench, bench.shipped_steps() - before)
            typical_step = ("the in-replica training step", step_s)

        if "run" in args.loop:
            def run_block(name: str) -> list[float]:  # one strategy.run per step, timed on the client
                bench.switch(name)
                times = []
                for _ in range(args.block):
                    start = time.perf_counter()
                    strategy.run(_train_step, args=(model_id,))
                    times.append(time.perf_counter() - start)
                return times

            run_block("off")  # warm-up
            bench.drain()
            before = bench.shipped_steps()
            bench.abba(max(2, args.steps // args.block), run_block)
            bench.drain()
            _report(f"custom loop: one strategy.run per training step, timed on the client ({args.block} steps per "
                    "block)", bench, bench.shipped_steps() - before)

        if "fit" in args.loop:
            dataset = tutorial_dataset(client, images, labels, BATCH_PER_REPLICA * replicas, replicas)
            steps = max(strategy.experimental_distribute_dataset(dataset).plan().steps_per_replica())

            def fit_block(name: str) -> list[float]:  # one epoch; per step: epoch time / steps
                bench.switch(name)
                start = time.perf_counter()
                bench.model.fit(dataset, epochs=1, verbose=0)
                return [(time.perf_counter() - start) / steps]

            fit_block("off")  # warm-up
            bench.drain()
            before = bench.shipped_steps()
            bench.abba(args.epochs, fit_block)
            bench.drain()
            shipped = bench.shipped_steps() - before
            _report(f"model.fit, one epoch per block ({steps} steps per epoch; per step: epoch time / steps)",
                    bench, shipped)
            expected = args.epochs * steps * replicas  # fit steps run with shipping on, all replicas
            if shipped < expected // 2 and not args.null:
                print(f"note: {expected} fit steps ran with shipping on, {shipped} step records reached the scheduler "
                      "(the commands that switch shipping): fit does not ship its step timings, so this loop "
                      "compares nothing but noise\n")

        if "cost" in args.loop:
            per_round = strategy.experimental_local_results(strategy.run(_replica_cost, args=(2000, 20)))[0]
            (off_med, off_mean), (on_med, on_mean) = np.median(per_round, axis=0) * 1e6
            added = float(np.median(per_round[:, 1, 0] - per_round[:, 0, 0])) * 1e6
            added_mean = float(np.median(per_round[:, 1, 1] - per_round[:, 0, 1])) * 1e6
            print("cost per step, measured directly on replica 0: an empty timed step (runtime.run_step), "
                  "20 rounds of 2,000 steps with shipping off and on (medians over rounds)")
            print(format_table(["log-events", "median us/step", "mean us/step"],
                               [["on", f"{on_med:.1f}", f"{on_mean:.1f}"], ["off", f"{off_med:.1f}", f"{off_mean:.1f}"]]))
            added = max(added, added_mean)
            print(f"shipping adds {added:.1f} us per step (the larger of the median and mean differences)", flush=True)
            if typical_step is not None:
                what, step_s = typical_step
                print(f"= {100 * added * 1e-6 / step_s:.2f}% of {what} ({step_s * 1e3:.3f} ms, median with shipping "
                      "off): replica 0's own share; the end-to-end ratios above also include the other replicas' "
                      "shipping, the workers' event loops and the scheduler, on the same cores")
            print(flush=True)


if __name__ == "__main__":
    main()
