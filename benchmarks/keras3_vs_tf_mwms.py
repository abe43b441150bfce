"""Keras 3 ``fit`` under ``dd.MirroredStrategy`` against tf-keras under TensorFlow's MultiWorkerMirroredStrategy.

The second comparison: the tutorial's CNN of ``benchmarks/keras3_training.py``
(Conv2D(32, 3) - MaxPooling2D - Flatten - Dense(64) - Dense(10), Adam) on the
same synthetic 28x28x1 rows, the same global batch, 2 replicas on the same
2 cores:

* ``keras3-dd``: Keras 3 (torch backend) made in ``dd.MirroredStrategy`` on a
  2-process local cluster (one torch thread per replica), ``model.fit``;
* ``tf-mwms``: tf-keras 2.21 in ``tf.distribute.MultiWorkerMirroredStrategy``,
  2 TF tasks on localhost (``TF_CONFIG``; one intra-op thread each, RING
  collectives; ``benchmarks/peers/tf_mwms_cnn28.py``): what a TensorFlow user
  runs for multi-worker data parallelism (Keras 3's ``fit`` fails under TF's
  MWMS, keras #20585).

Per round and arm one measured epoch after a warm-up epoch (TF: a fresh pair of
tasks per round, its second epoch; the slower task's time), ``--rounds``
rounds alternated, the load printed before each; samples/s.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/keras3_vs_tf_mwms.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from _common import alternating_rounds, format_table, local_cluster, print_header  # noqa: E402
from keras3_training import keras3_cnn  # noqa: E402

import daskdist as dd  # noqa: E402

MARKER = "@@tf-mwms-result "


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_tf_tasks(args: list[str]) -> list[dict]:
    """Start 2 TF tasks of ``peers/tf_mwms_cnn28.py`` with ``args`` on localhost; each task's result."""
    ports = _free_ports(2)
    workers = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    for index in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"worker": workers},
                                                     "task": {"type": "worker", "index": index}}))
        env.pop("KERAS_BACKEND", None)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "peers" / "tf_mwms_cnn28.py"), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        line = next(x for x in out.splitlines() if x.startswith(MARKER))
        results.append(json.loads(line[len(MARKER):]))
    return results


def tf_mwms_samples_per_second(samples: int, batch: int) -> float:
    """Start 2 TF tasks, train 2 epochs, return samples/s of the second epoch (the slower task)."""
    results = run_tf_tasks(["--samples", str(samples), "--global-batch", str(batch), "--epochs", "2"])
    return round(samples / max(r["epoch_seconds"][-1] for r in results), 1)


def main(args: argparse.Namespace) -> None:
    import importlib.metadata

    import keras

    print_header("Keras 3 fit under dd.MirroredStrategy (2 replicas) vs tf-keras under TF's MultiWorkerMirroredStrategy")
    print(f"Keras {keras.__version__} backend {keras.backend.backend()}; TensorFlow {importlib.metadata.version('tensorflow-cpu')} (tf-keras {importlib.metadata.version('tf-keras')}); "
          f"global batch {args.batch}, {args.samples} samples per epoch, {args.rounds} rounds\n", flush=True)
    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, args.samples).astype(np.int64)
    with local_cluster(2) as client:
        strategy = dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client)
        dataset = dd.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
        with strategy.scope():
            k3 = keras3_cnn()
        k3.fit(dataset, epochs=1, verbose=0)  # warm-up: install, first-touch allocations

        def samples_per_second(arm: str) -> float:
            if arm == "tf-mwms":
                return tf_mwms_samples_per_second(args.samples, args.batch)
            start = time.perf_counter()
            k3.fit(dataset, epochs=1, verbose=0)
            return round(args.samples / (time.perf_counter() - start), 1)

        results = alternating_rounds(["keras3-dd", "tf-mwms"], args.rounds, samples_per_second, show_load=True)
        strategy.close()
    base = statistics.median(results["tf-mwms"])
    rows = [[name, f"{statistics.median(v):.0f}", f"{min(v):.0f}-{max(v):.0f}", f"{statistics.median(v) / base:.2f}"]
            for name, v in results.items()]
    print()
    print(format_table(["run", "samples/s (median)", "range", "vs tf-mwms"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    main(parser.parse_args())
