"""Time to 97 % test accuracy: Keras 3 under ``dd.MirroredStrategy`` against plain Keras 3, daskdist's built-in
layers and tf-keras under TensorFlow's MultiWorkerMirroredStrategy.

The second figure besides samples/s. MNIST itself cannot be downloaded
on the machines this project runs on, so the data are MNIST-shaped handwritten
digits: scikit-learn's real digits (8x8, 1,797 images, the split and order of
``examples/_digits.py``), each pixel made a 3x3 block and framed to 28x28x1,
the training images also shifted by 2 pixels in 8 directions (9 x 1,437 =
12,933 training rows, 360 test rows never shifted), scaled to [0, 1]. The
model is the tutorial's CNN of ``benchmarks/keras3_training.py`` (Adam), every
arm's initial weights from seed 0, the same global batch (128) and the same
row order every epoch (no shuffle):

* ``keras3-dd``: Keras 3 (torch backend) created in
  ``dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"]).scope()`` on a 2-process
  local cluster, ``model.fit`` with ``validation_data``;
* ``keras3-plain``: the same model in this one process, torch on 2 threads;
* ``builtin-dd``: daskdist's built-in layers under the same strategy;
* ``tf-mwms``: tf-keras 2.21 under TensorFlow's ``MultiWorkerMirroredStrategy``,
  2 tasks on localhost, one intra-op thread each (``peers/tf_mwms_cnn28.py --data``).

Each arm validates on the test rows after every epoch and stops at the first
epoch whose test accuracy reaches ``--target``; its time is the wall time from
the start of ``fit`` to that epoch's end: training, each epoch's validation and
what ``fit`` does before its first step (TF: tracing its step functions;
daskdist: installing the fresh model on the replicas). The cluster's and the
TF tasks' process starts are not counted; daskdist's arms and plain Keras run
one warm-up ``fit`` first (imports, first-touch allocations).
``--rounds`` rounds alternated, the load printed before each arm.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=$PWD .venv/bin/python benchmarks/keras3_time_to_accuracy.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from _common import alternating_rounds, format_table, local_cluster, print_header  # noqa: E402
from keras3_training import builtin_cnn, keras3_cnn  # noqa: E402
from keras3_vs_tf_mwms import run_tf_tasks  # noqa: E402

import daskdist as dd  # noqa: E402

SHIFTS = [(0, 0), (-2, 0), (2, 0), (0, -2), (0, 2), (-2, -2), (-2, 2), (2, -2), (2, 2)]


def digits28() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST-shaped digits: (x_train, y_train, x_test, y_test), 28x28x1 float32 in [0, 1], int64 labels."""
    sys.path.insert(0, str(HERE.parent / "examples"))
    from _digits import load_data

    (train_images, train_labels), (test_images, test_labels), pixel_max = load_data(None)

    def framed(images: np.ndarray) -> np.ndarray:
        big = np.kron(images[..., 0] / pixel_max, np.ones((1, 3, 3), np.float32))  # 8x8 -> 24x24
        return np.pad(big, ((0, 0), (2, 2), (2, 2)))[..., None].astype(np.float32)  # -> 28x28x1

    train = framed(train_images)  # the 2-pixel frame is zeros: a roll by 2 moves no ink across an edge
    x_train = np.concatenate([np.roll(train, shift, axis=(1, 2)) for shift in SHIFTS])
    y_train = np.concatenate([train_labels] * len(SHIFTS))
    order = np.random.default_rng(1).permutation(len(y_train))  # one fixed order for every arm and epoch
    return x_train[order], y_train[order], framed(test_images), test_labels


def until_callback(base: type, target: float, reached: dict[str, list[float]]) -> Any:
    """A callback (subclass of ``base``) keeping the seconds since ``fit`` began and the test accuracy at each
    epoch's end; training stops once that accuracy reaches ``target``."""

    class Until(base):  # type: ignore[misc, valid-type]
        def on_train_begin(self, logs: dict | None = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            reached["seconds"].append(time.perf_counter() - self.start)
            reached["val_accuracy"].append(float((logs or {})["val_accuracy"]))
            if reached["val_accuracy"][-1] >= target:
                self.model.stop_training = True

    return Until()


def tf_mwms_to_target(path: str, batch: int, epochs: int, target: float) -> dict[str, list[float]]:
    """2 TF tasks on the data at ``path`` until ``target``: task 0's seconds and accuracies per epoch."""
    first = run_tf_tasks(["--data", path, "--target", str(target), "--global-batch", str(batch),
                          "--epochs", str(epochs)])[0]
    return {"seconds": first["seconds"], "val_accuracy": first["val_accuracy"]}


def _summary(reached: dict[str, list[float]], target: float) -> dict[str, Any]:
    """The epoch (1-based) and seconds at which ``target`` was reached (None: not within the epochs)."""
    hit = next((i for i, a in enumerate(reached["val_accuracy"]) if a >= target), None)
    return {"epochs": None if hit is None else hit + 1, "seconds": None if hit is None else reached["seconds"][hit],
            "best": max(reached["val_accuracy"]), "per_epoch": reached["seconds"][-1] / len(reached["seconds"])}


def main(args: argparse.Namespace) -> None:
    import importlib.metadata

    import keras
    import torch

    print_header("Time to test accuracy: Keras 3 under dd.MirroredStrategy vs plain Keras 3, built-in layers, "
                 "tf-keras under TF's MWMS")
    x, y, x_test, y_test = digits28()
    print(f"Keras {keras.__version__} backend {keras.backend.backend()}, torch {torch.__version__}; TensorFlow "
          f"{importlib.metadata.version('tensorflow-cpu')} (tf-keras {importlib.metadata.version('tf-keras')}); "
          f"{len(y)} training rows, {len(y_test)} test rows (28x28x1 digits), global batch {args.batch}, "
          f"target test accuracy {args.target}, at most {args.epochs} epochs, {args.rounds} rounds\n", flush=True)
    data = tempfile.NamedTemporaryFile(suffix=".npz", delete=False)
    np.savez(data.name, x_train=x, y_train=y, x_test=x_test, y_test=y_test)
    summaries: dict[str, list[dict[str, Any]]] = {}
    try:
        with local_cluster(2) as client:
            strategy = dd.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], client=client)
            train = dd.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
            test = dd.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch)
            torch.set_num_threads(2)

            def fresh(arm: str) -> Any:
                keras.utils.set_random_seed(0)
                if arm == "keras3-plain":
                    return keras3_cnn()
                with strategy.scope():
                    return keras3_cnn() if arm == "keras3-dd" else builtin_cnn()

            def fit(arm: str, model: Any, epochs: int, callbacks: list) -> None:
                if arm == "keras3-plain":
                    model.fit(x, y, batch_size=args.batch, epochs=epochs, shuffle=False, verbose=0,
                              validation_data=(x_test, y_test), callbacks=callbacks)
                else:
                    model.fit(train, epochs=epochs, verbose=0, validation_data=test, callbacks=callbacks)

            for arm in ("keras3-dd", "keras3-plain", "builtin-dd"):  # warm-up: installs, first-touch allocations
                fit(arm, fresh(arm), 1, [])

            def seconds_to_target(arm: str) -> float | None:
                reached: dict[str, list[float]] = {"seconds": [], "val_accuracy": []}
                if arm == "tf-mwms":
                    reached = tf_mwms_to_target(data.name, args.batch, args.epochs, args.target)
                else:
                    model = fresh(arm)
                    base = dd.keras.callbacks.Callback if arm == "builtin-dd" else keras.callbacks.Callback
                    fit(arm, model, args.epochs, [until_callback(base, args.target, reached)])
                summary = _summary(reached, args.target)
                summaries.setdefault(arm, []).append(summary)
                return None if summary["seconds"] is None else round(summary["seconds"], 2)

            arms = ["keras3-dd", "keras3-plain", "builtin-dd"] + ([] if args.no_tf else ["tf-mwms"])
            alternating_rounds(arms, args.rounds, seconds_to_target, show_load=True)
            strategy.close()
    finally:
        os.unlink(data.name)
    reached_by = {arm: [s["seconds"] for s in runs if s["seconds"] is not None] for arm, runs in summaries.items()}
    base = statistics.median(reached_by["keras3-plain"]) if reached_by.get("keras3-plain") else None
    rows = []
    for arm, runs in summaries.items():
        times = reached_by[arm]
        median = statistics.median(times) if times else None
        rows.append([arm, f"{median:.1f}" if median else "not reached",
                     f"{min(times):.1f}-{max(times):.1f}" if times else "-",
                     "/".join(str(s["epochs"]) for s in runs), f"{statistics.median(s['per_epoch'] for s in runs):.2f}",
                     f"{max(s['best'] for s in runs):.3f}",
                     f"{base / median:.2f}" if base and median else "-"])
    print()
    print(format_table(["run", f"s to {args.target:.0%} (median)", "range", "epochs (per round)", "s per epoch",
                        "best test acc", "speed vs keras3-plain"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--epochs", type=int, default=20, help="at most this many epochs per arm")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-tf", action="store_true", help="leave out the tf-mwms arm")
    main(parser.parse_args())
