"""TensorFlow's own MultiWorkerMirroredStrategy all-reduce, one process per host (a benchmark peer).

Run inside each namespace host with ``TF_CONFIG`` pointing at the hosts'
addresses; ``CommunicationOptions(implementation=RING)``; float32 SUM of a
tensor of ones per size, timed inside the process with ``time.perf_counter``
(each timed call is one ``strategy.run`` of a ``tf.function`` holding the
all-reduce). Prints ``RESULT_MARKER`` and ``{"times": {size: [seconds, ...]}, "walls": {size: seconds per call}}``.

    TF_CONFIG=... python benchmarks/peers/tf_mwms_allreduce.py --sizes 4096 262144 --iterations 50 5
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULT_MARKER = "@@allreduce-result "

__all__ = ["main"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--iterations", type=int, nargs="+", required=True)
    args = parser.parse_args()
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    times: dict[str, list[float]] = {}
    walls: dict[str, float] = {}  # wall time per all-reduce over the timed loop, the untimed calls included
    for nbytes, iterations in zip(args.sizes, args.iterations):
        value = tf.ones([nbytes // 4], tf.float32)

        @tf.function
        def step(x):
            # tf.identity puts the tensor on the replica's device (/job:worker/...): reducing the argument as
            # given (a /job:localhost tensor) fails in TF's MWMS with "destinations can not be empty"
            return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce("SUM", tf.identity(t)),
                                args=(x,))

        for _ in range(3):
            step(value)
        samples = []
        began = time.perf_counter()
        for _ in range(iterations):
            step(value)  # untimed: the ranks enter the timed call together
            start = time.perf_counter()
            result = step(value)
            _ = strategy.experimental_local_results(result)[0].numpy()[0]
            samples.append(time.perf_counter() - start)
        walls[str(nbytes)] = (time.perf_counter() - began) / (2 * iterations)
        times[str(nbytes)] = samples
    print(RESULT_MARKER + json.dumps({"times": times, "walls": walls}), flush=True)


if __name__ == "__main__":
    main()
