"""TensorFlow's in-process ``MirroredStrategy.run`` of a step with one 4 KiB all-reduce (a peer of run_overhead.py).

Two logical CPU devices in one process (TensorFlow's own single-machine
model: replicas are threads), the step all-reduces 1024 float32 with
``ReplicaContext.all_reduce(SUM)``. Timed on the caller's side with
``time.perf_counter`` per ``strategy.run`` call, eagerly and inside a
``tf.function`` (how TensorFlow's guides write training steps). Prints one
JSON line: ``{"eager": [seconds...], "function": [seconds...]}``.

Usage: ``python benchmarks/peers/tf_mirrored_run.py --calls 200 --warmup 20 --replicas 2``
"""

from __future__ import annotations

import argparse
import json
import os
import time

__all__ = ["main"]


def main() -> None:
    """Time the step eagerly and in a ``tf.function``; print the times as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    def step() -> tf.Tensor:  # the array is made inside the step, as daskdist's benchmark step does
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.ones(1024, tf.float32))

    @tf.function
    def step_in_function() -> tf.Tensor:
        return strategy.run(step)

    out = {}
    for name, call in (("eager", lambda: strategy.run(step)), ("function", step_in_function)):
        result = strategy.experimental_local_results(call())
        if any(float(r[0]) != args.replicas for r in result):
            raise RuntimeError(f"TF all-reduce gave {[float(r[0]) for r in result]}, expected {args.replicas}")
        for _ in range(args.warmup):
            call()
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[name] = times
    print(json.dumps(out))


if __name__ == "__main__":
    main()
