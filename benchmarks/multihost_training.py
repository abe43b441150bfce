"""Training across real separate hosts: the tutorial model's samples/s, daskdist's MWMS next to TensorFlow's.

Two namespace hosts (``tests/netns.py``, as ``multihost_allreduce.py``: own
network, host name and ``/dev/shm`` each, links shaped to ``--rate``, default
10gbit) with two single-threaded Dask workers each. The tutorial's model and
data (``examples/mnist_mirrored.py``: the CNN on scikit-learn's digits 8x8,
1437 training images) are trained at the same global batch
(``--batch-per-replica`` x 4 replicas, default 16 x 4 = 64) by:

* **daskdist**: ``dd.MultiWorkerMirroredStrategy(client=...)`` over the four
  Dask workers (2 hosts x 2 replicas), the tutorial's pipeline
  (``from_dask(...).map(scale).cache().shuffle(10_000, seed=0).batch(global)``
  over Dask arrays persisted on the workers), the model built and compiled in
  ``strategy.scope()``, ``fit(verbose=0)``; epochs timed on the client.
* **TensorFlow**: ``tf.distribute.MultiWorkerMirroredStrategy`` with the same
  model in tf-keras (``peers/tf_mwms_training.py``), four TF tasks (2 per host,
  one CPU replica and one intra-op thread each), started inside the hosts'
  namespaces with ``TF_CONFIG`` on the namespace addresses
  (``multihost_allreduce.run_tf_tasks``); an epoch's time is the slowest
  task's. The Dask workers stay up (idle) meanwhile.

Figure: samples per second of the median epoch after ``--warmup-epochs``
(default 1) warm-up epochs; ratio daskdist / TF.

Usage (as root; OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, if the machine sets them, halve numpy's matmul)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/multihost_training.py [--epochs 11]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "examples")]

from _common import blas_in_use, format_table, namespace_cluster, print_header  # noqa: E402
from multihost_allreduce import run_tf_tasks  # noqa: E402

__all__ = ["main"]


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {message}", file=sys.stderr, flush=True)


def _worker_blas() -> str:
    """``blas_in_use`` on a worker (whose path has the repository, not ``benchmarks/``: ``_common`` is not importable
    there, so this script's function travels by value)."""
    from benchmarks._common import blas_in_use as on_worker

    return on_worker()


def _daskdist(client, epochs: int, batch_per_replica: int) -> tuple[list[float], int, int, list[float]]:
    """daskdist's MWMS ``fit`` of the tutorial; (epoch seconds, training samples, replicas, epoch losses)."""
    import dask.array as da
    from mnist_mirrored import load_data
    from training_parts.keras_parts import EpochTimer, build_cnn

    import daskdist as dd

    (images, labels), _, pixel_max = load_data(None)
    with dd.MultiWorkerMirroredStrategy(client=client) as strategy:
        replicas = strategy.num_replicas_in_sync
        chunk = max(1, len(labels) // (4 * replicas))  # as the tutorial

        def on_cluster(array):
            return client.persist(da.from_array(array, chunks=(chunk,) + array.shape[1:]))

        def scale(image, label):
            return (image / pixel_max).astype("float32"), label

        dataset = (dd.data.Dataset.from_dask((on_cluster(images), on_cluster(labels)))
                   .map(scale).cache().shuffle(10_000, seed=0).batch(batch_per_replica * replicas))
        with strategy.scope():
            model = build_cnn(images.shape[1:])
        timer = EpochTimer("daskdist")
        history = model.fit(dataset, epochs=epochs, verbose=0, callbacks=[timer])
    return timer.seconds, len(labels), replicas, history.history["loss"]


def _tf(hosts, per_host: int, epochs: int, batch_per_replica: int) -> tuple[list[float], int, str, list[float]] | str:
    """TF's MWMS ``fit`` in tf-keras, one task per replica; (slowest task's epoch seconds, samples, info, losses) or
    why not."""
    results = run_tf_tasks(hosts, per_host, "benchmarks/peers/tf_mwms_training.py",
                           ["--global-batch", str(batch_per_replica * per_host * len(hosts.hosts)),
                            "--epochs", str(epochs)], timeout=400)
    if isinstance(results, str):
        return results
    slowest = [max(r["epoch_seconds"][e] for r in results) for e in range(epochs)]
    first = results[0]
    return slowest, first["samples"], f"{first['replicas']} replicas, {first['threads']}, BLAS {first['blas']}", first["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=11, help="epochs per system, warm-ups included (default 11)")
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--batch-per-replica", type=int, default=16, help="the tutorial's on digits (default 16)")
    parser.add_argument("--rate", default="10gbit", help="every host's link rate (default 10gbit)")
    parser.add_argument("--systems", nargs="+", default=["daskdist", "tf"], choices=["daskdist", "tf"])
    args = parser.parse_args()
    if args.epochs <= args.warmup_epochs:
        parser.error("--epochs must exceed --warmup-epochs")
    print_header("Training across namespace hosts (2 x 2 replicas): daskdist MultiWorkerMirroredStrategy vs TF's")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  BLAS (client): {blas_in_use()}  "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
          f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')}", flush=True)

    per_host = 2
    results: dict[str, tuple[list[float], int, str, list[float]] | str] = {}
    loads = []
    with namespace_cluster(2, per_host, rate=args.rate) as (hosts, client):
        blas = set(client.run(_worker_blas).values())
        for system in args.systems:
            loads.append(os.getloadavg()[0])
            start = time.monotonic()
            if system == "daskdist":
                seconds, samples, replicas, losses = _daskdist(client, args.epochs, args.batch_per_replica)
                results[system] = (seconds, samples, f"{replicas} replicas (Dask workers), BLAS {' / '.join(blas)}",
                                   losses)
            else:
                results[system] = _tf(hosts, per_host, args.epochs, args.batch_per_replica)
            _log(f"{system}: {time.monotonic() - start:.0f} s, {results[system]}")
    loads.append(os.getloadavg()[0])
    rows, speed = [], {}
    names = {"daskdist": "daskdist dd.MultiWorkerMirroredStrategy", "tf": "TF MultiWorkerMirroredStrategy (tf-keras)"}
    for system, result in results.items():
        if isinstance(result, str):
            rows.append([names[system], "-", "-", "-", "-", "-", "-"])
            print(f"{names[system]}: {result}")
            continue
        seconds, samples, info, losses = result
        measured = seconds[args.warmup_epochs:]
        speed[system] = samples / statistics.median(measured)
        print(f"{names[system]}: {info}")
        rows.append([names[system], str(args.batch_per_replica * 2 * per_host), str(samples),
                     f"{seconds[0]:.2f}", " ".join(f"{s:.2f}" for s in measured), f"{losses[0]:.3f} -> {losses[-1]:.3f}",
                     f"{speed[system]:.0f}"])
    print()
    print(format_table(["system", "global batch", "samples/epoch", "warm-up epoch s", "measured epochs s",
                        "loss first -> last epoch", "samples/s (median epoch)"], rows))
    if len(speed) == 2:
        print(f"\ndaskdist / TF samples/s: {speed['daskdist'] / speed['tf']:.2f}")
    print(f"load average (1 min) before each system and at the end: {' '.join(f'{x:.2f}' for x in loads)}")


if __name__ == "__main__":
    main()
