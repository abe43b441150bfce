"""The MirroredStrategy API alone, on an embedded local cluster: no model, no data.

Run: ``python examples/quickstart.py [--replicas N]`` (``make run`` runs
``examples/mnist_mirrored.py``, the Keras tutorial, instead). Starts a
``LocalCluster`` with one replica per core (at least 2), creates a mirrored
variable, runs a step with a nested all-reduce on every replica, reduces and
gathers the results on the client, and closes everything.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

import daskdist as dd

logger = logging.getLogger("quickstart")


def main(replicas: int | None) -> None:
    devices = [f"/cpu:{i}" for i in range(replicas)] if replicas else None
    with dd.MirroredStrategy(devices=devices) as strategy:
        print(f"Replicas in sync: {strategy.num_replicas_in_sync}")
        print(f"Devices: {list(strategy.extended.worker_devices)}")
        print(f"Dashboard: {strategy.dashboard_link}")

        with strategy.scope():
            v = dd.Variable(np.zeros(3, np.float32), aggregation=dd.VariableAggregation.MEAN, name="v")

        def step(x):
            ctx = dd.get_replica_context()
            local = x * (ctx.replica_id_in_sync_group + 1)
            total = ctx.all_reduce(dd.ReduceOp.SUM, {"a": local, "b": [local, local]})
            v.assign_add(total["a"])
            return total["a"]

        out = strategy.run(step, args=(np.ones(3, np.float32),))
        print("run ->", out)
        print("local results ->", strategy.experimental_local_results(out))
        print("reduce MEAN ->", strategy.reduce(dd.ReduceOp.MEAN, out, axis=None))
        print("gather axis 0 ->", strategy.gather(out, axis=0))

        vals = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.full(2, ctx.replica_id_in_sync_group)
        )
        gathered = strategy.run(lambda x: dd.get_replica_context().all_gather(x, axis=0), args=(vals,))
        print("all_gather ->", strategy.experimental_local_results(gathered)[0])
        print("variable after one step ->", v.numpy())

        n = strategy.num_replicas_in_sync
        expected = np.full(3, n * (n + 1) / 2, np.float32)
        assert np.allclose(v.numpy(), expected), (v.numpy(), expected)
        timings = strategy.step_timings(last=1)
        for replica, steps in enumerate(timings):
            t = steps[-1]
            print(
                f"replica {replica}: step {t['total'] * 1e3:.2f} ms "
                f"(compute {t['compute'] * 1e3:.2f}, all-reduce {t['allreduce'] * 1e3:.2f}, apply {t['apply'] * 1e3:.2f})"
            )
    print("OK: strategy closed, embedded cluster shut down")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=None, help="CPU replicas (default: one per core, at least 2)")
    logging.basicConfig(level=logging.WARNING)
    main(parser.parse_args().replicas)
