"""TensorFlow's own split of global batches over replicas: the reference for daskdist's tests.

Prints what ``tf.distribute.MirroredStrategy`` over 3 logical CPU devices
gives for the datasets that ``tests/test_distributed_input.py``
(``test_global_batches_are_split_as_tensorflow_splits_them``) checks, and the
``element_spec`` of a ``drop_remainder`` batch. TensorFlow is a ``bench``
extra only (never a runtime or test dependency). With TF 2.21 it prints::

    range(8).batch(4) [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]
    range(9).batch(4) [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [], []]]
    range(10).batch(7) [[[0, 1, 2], [3, 4, 5], [6]], [[7], [8], [9]]]
    range(11).batch(7) [[[0, 1, 2], [3, 4, 5], [6]], [[7, 8], [9, 10], []]]
    range(9).batch(4, drop_remainder=True) [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]
    range(2).batch(2) [[[0], [1], []]]
    range(9).batch(4).repeat(2) [... the three steps of range(9).batch(4), twice]

Usage::

    .venv/bin/python benchmarks/tf_split_reference.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

CASES = {
    "range(8).batch(4)": lambda: tf.data.Dataset.range(8).batch(4),
    "range(9).batch(4)": lambda: tf.data.Dataset.range(9).batch(4),
    "range(10).batch(7)": lambda: tf.data.Dataset.range(10).batch(7),
    "range(11).batch(7)": lambda: tf.data.Dataset.range(11).batch(7),
    "range(9).batch(4, drop_remainder=True)": lambda: tf.data.Dataset.range(9).batch(4, drop_remainder=True),
    "range(2).batch(2)": lambda: tf.data.Dataset.range(2).batch(2),
    "range(9).batch(4).repeat(2)": lambda: tf.data.Dataset.range(9).batch(4).repeat(2),
}


def main() -> None:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 3)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    print("tensorflow", tf.__version__)
    for name, make in CASES.items():
        steps = [[v.numpy().tolist() for v in strategy.experimental_local_results(x)]
                 for x in strategy.experimental_distribute_dataset(make())]
        print(name, steps)
    print("element_spec of range(9).batch(4, drop_remainder=True):",
          tf.data.Dataset.range(9).batch(4, drop_remainder=True).element_spec)
    dataset = tf.data.Dataset.from_tensor_slices((tf.range(6), tf.range(6) * 10)).batch(3)
    x, y = next(iter(strategy.experimental_distribute_dataset(dataset)))
    print("for x, y in dist:", type(x).__name__, type(y).__name__)


if __name__ == "__main__":
    main()
