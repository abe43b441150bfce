"""Keras 3 on its JAX backend under daskdist, run as a user runs it: ``KERAS_BACKEND=jax python -m ...``.

Keras fixes its backend per process when it is imported, and the pytest
process runs the other Keras 3 modules on torch: ``tests/test_keras3_jax.py``
runs this script once in a subprocess with ``KERAS_BACKEND=jax``, every scenario
its tests ask for in that one process (one JAX and Keras import, one cluster of
3 threaded workers for the scenarios that share it), and reads the JSON line it
prints last: each scenario's result, or the traceback it raised. Each scenario
compares daskdist with plain Keras-JAX in this process on the same global
batches and reports the largest differences (the tests assert them), so a
failure shows by how much.

    python -m tests.support.keras3_jax find_spec spmd held weights elastic matrix --workdir DIR

``elastic`` runs on its own worker processes; ``matrix`` runs the matrix modules' ``keras3-jax`` cases with
pytest in this process (their ``matrix_client`` is 3 threaded workers of it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "jax")

import daskdist as dd  # noqa: E402
from daskdist.plugins import keras3 as keras3_plugin  # noqa: E402

# daskdist imported first, then an availability check of Keras that imports nothing, then ``import keras``: the
# ``find_spec`` scenario (the wrapping must be left to that import, not used up by the check)
FIND_SPEC_THEN_IMPORT = {"found": importlib.util.find_spec("keras") is not None,
                         "installed_before": keras3_plugin.installed()}

import keras  # noqa: E402
import numpy as np  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

FIND_SPEC_THEN_IMPORT["installed_after"] = keras3_plugin.installed()

from tests.keras3_models import (  # noqa: E402
    assert_replicas_identical,
    bn_dropout,
    compile_model,
    dense_data,
    mnist_shaped,
    replica_states,
    sequential,
    tutorial_cnn,
    twin,
)
from tests.support import keras3_jax_weights  # noqa: E402
from tests.support.closeness import max_rel, same  # noqa: E402

TWO = ["/cpu:0", "/cpu:1"]


def _fit_case(strategy, build, x, y, epochs=2):
    with strategy.scope():
        model = compile_model(build())
    plain = twin(model, build)
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    expected = plain.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    assert_replicas_identical(strategy, model)
    return model, plain, {
        "weights": max_rel(model.get_weights(), plain.get_weights()),
        "loss": max_rel(history.history["loss"], expected.history["loss"]),
        "accuracy": max_rel(history.history["accuracy"], expected.history["accuracy"]),
        "evaluate": max_rel(model.evaluate(x, y, batch_size=32, verbose=0), plain.evaluate(x, y, batch_size=32,
                                                                                             verbose=0)),
        "predict": max_rel([model.predict(x, verbose=0)], [plain.predict(x, verbose=0)], atol=1e-5),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def spmd(client, workdir):
    """The tutorial CNN under Mirrored (2 replicas): fit, evaluate, predict, save and load; BN and dropout."""
    out = {}
    x, y = mnist_shaped()  # 3 global batches of 32, 32, 16
    # Fixed initial weights. The replicas' gradients (two half batches, summed) and plain Keras' (one batch) agree
    # to float32 rounding (~1e-8), but some random inits put a ReLU input or a max-pool near-tie within that
    # rounding, which then sends a gradient elsewhere: the conv weights differ by ~3e-5 (init seed 3 does it on
    # every run, with or without daskdist's changes; unseeded, about 1 run in 10 drew such an init)
    keras.utils.set_random_seed(0)
    with dd.MirroredStrategy(devices=TWO, client=client) as strategy:
        model, plain, out["cnn"] = _fit_case(strategy, tutorial_cnn, x, y)
        path = os.path.join(workdir, "model.keras")
        model.save(path)
        np.save(os.path.join(workdir, "x.npy"), x)
        np.save(os.path.join(workdir, "expected.npy"), model.predict(x, verbose=0))  # what the file must predict
        with strategy.scope():  # load_model in the scope: a model of the strategy that trains on
            loaded = keras.models.load_model(path)
        loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        out["loaded_trains_on"] = max_rel(loaded.get_weights(), plain.get_weights())
        out["replicas"] = strategy.num_replicas_in_sync

        xs, ys = dense_data(rows=96)
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = compile_model(bn_dropout())
        model.fit(xs, ys, batch_size=32, epochs=2, shuffle=False, verbose=0)
        states = assert_replicas_identical(strategy, model)  # moving statistics averaged: identical copies
        seeds = [s["rng"].states for s in states]
        out["bn_dropout"] = {"replicas_equal": all(same(states[0]["variables"], s["variables"]) for s in states[1:]),
                             "own_streams": not np.array_equal(seeds[0][0], seeds[1][0])}

        def bn():  # no dropout: one step over 32 rows split 16/16 gives the whole batch's moving mean
            return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                                     keras.layers.Dense(4)])

        with strategy.scope():
            model = compile_model(bn())
        plain = twin(model, bn)
        model.fit(xs[:32], ys[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)
        plain.fit(xs[:32], ys[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)
        expected = plain.layers[1].moving_mean.numpy()
        out["bn_dropout"]["moving_mean"] = max_rel([model.layers[1].moving_mean.numpy()], [expected], atol=1e-7)
        out["bn_dropout"]["moving_mean_moved"] = bool(np.any(expected != 0))
    # the custom loop and every strategy combination's fit: the matrix modules' keras3-jax cases
    # (tests/test_keras3_jax.py runs them)
    # the saved file, in a process with plain Keras on JAX and no daskdist imported
    script = ("import sys, numpy as np, keras; assert 'daskdist' not in sys.modules; "
              f"m = keras.models.load_model({path!r}); x = np.load({os.path.join(workdir, 'x.npy')!r}); "
              f"e = np.load({os.path.join(workdir, 'expected.npy')!r}); p = m.predict(x, verbose=0); "
              "print(float(np.max(np.abs(p - e))), keras.backend.backend())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "jax"})
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    value, backend = done.stdout.split()[-2:]
    out["plain_load"] = {"predict_abs_diff": float(value), "backend": backend}
    return out


def held(client, workdir):
    """CentralStorage with SGD and momentum: the parameters held once, the update rule on the holder."""
    out = {}
    x, y = mnist_shaped()
    keras.utils.set_random_seed(0)  # fixed initial weights, as in spmd

    def sgd():
        return keras.optimizers.SGD(0.05, momentum=0.9)

    with dd.experimental.CentralStorageStrategy(TWO, client=client) as strategy:
        with strategy.scope():
            model = compile_model(tutorial_cnn(), sgd())
        plain = twin(model, tutorial_cnn, sgd())
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        states = replica_states(strategy, model)
        out["central_storage"] = {
            "weights": max_rel(model.get_weights(), plain.get_weights()),
            "loss": max_rel(history.history["loss"], expected.history["loss"]),
            "iterations": int(model.optimizer.iterations.numpy()),
            "replica_iterations": [int(s["optimizer"][0]) for s in states],
            "replicas_hold_the_stored": all(same(s["variables"], model.get_weights()) for s in states),
        }
    return out


def elastic(_client, workdir):
    """kill -9 of a ``dask worker`` (and its nanny) at step 5 of 10 of an elastic fit over 3 worker processes.

    The test harness's own worker set (``tests.support.processes.ProcessWorkers``: the workers inherit
    ``KERAS_BACKEND=jax``) and kill (``tests.support.killers.kill_at_step``), as in test_keras3_elastic.
    """
    from daskdist.plugins.keras3.backend import prepare_replica
    from tests.support.killers import kill_at_step
    from tests.support.models import slow_batch
    from tests.support.processes import ProcessWorkers

    workers = ProcessWorkers(3)
    try:
        # Keras and JAX imported on the workers before the elastic group starts (an import holding a loaded
        # worker's GIL for seconds would miss the group's heartbeats)
        backends = workers.client.run(lambda: prepare_replica("jax").backend.backend())
        x, y = dense_data(rows=240)
        train = dd.data.Dataset.from_tensor_slices((x, y)).batch(24).map(slow_batch)  # 10 steps per epoch
        options = dd.ElasticOptions(min_replicas=2, commit_every=2)

        def adam():
            return keras.optimizers.Adam(1e-2)

        with dd.MirroredStrategy(client=workers.client, elastic=options) as strategy:
            replicas_before = strategy.num_replicas_in_sync
            with strategy.scope():
                model = compile_model(sequential(), adam())
            plain = twin(model, sequential, adam())
            model.evaluate(x[:24], y[:24], verbose=0)  # the model on the replicas before the kill watcher starts
            plain.evaluate(x[:24], y[:24], verbose=0)
            victim = strategy.extended.worker_addresses[1]
            thread, record = kill_at_step(workers, victim, step=5)
            history = model.fit(train, epochs=2, verbose=0)
            thread.join(5)
            expected = plain.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
            assert_replicas_identical(strategy, model)
            events = history.elastic.events
            ledger = history.elastic.ledger
            return {
                "worker_backends": sorted(set(backends.values())),
                "killed": "killed" in record,
                "replicas": [replicas_before, strategy.num_replicas_in_sync],
                "victim_gone": victim not in strategy.extended.worker_addresses,
                "events": [{"lost": e.lost == [victim], "members": len(e.members), "commit": list(e.commit)}
                           for e in events],
                "steps": [ledger.steps(e) for e in (0, 1)],
                "rows": [sorted(ledger.positions(e).tolist()) == list(range(240)) for e in (0, 1)],
                "weights": max_rel(model.get_weights(), plain.get_weights()),
                "loss": max_rel(history.history["loss"], expected.history["loss"]),
                "accuracy": max_rel(history.history["accuracy"], expected.history["accuracy"]),
                "iterations": int(model.optimizer.iterations.numpy()),
            }
    finally:
        workers.close()


#: The matrix modules whose ``keras3-jax`` cases run here, and the cases: the one-replica combinations (default,
#: one_device) are left out on JAX (nothing there is distributed; they run on torch), and so is the callbacks
#: module (its callbacks run on the client, the same code for every backend; its epoch-callbacks case hung once
#: here with every thread waiting for the GIL, after two clean runs).
MATRIX_MODULES = [f"tests/test_matrix_{m}.py" for m in ("fit", "custom_loop", "ps")]
MATRIX_CASES = "keras3-jax and not default and not one_device"


class _Outcomes:
    """A pytest plug-in that counts the outcomes of the cases' calls and keeps each failure's report."""

    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}
        self.failures: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.counts[report.outcome] += 1
            if report.outcome == "failed":
                self.failures.append(f"{report.nodeid}: {report.longreprtext[-3000:]}")


def matrix(_client, workdir):
    """The matrix modules' ``keras3-jax`` cases, with pytest in this process: how many passed, failed, skipped."""
    import pytest

    outcomes = _Outcomes()
    exit_code = pytest.main([*MATRIX_MODULES, "-k", MATRIX_CASES, "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                             "-W", "ignore::DeprecationWarning", "--basetemp", os.path.join(workdir, "pytest")],
                            plugins=[outcomes])
    return {"exit": int(exit_code), **outcomes.counts, "failures": outcomes.failures}


def weights(client, _workdir):
    """``sample_weight``, ``class_weight`` and ``validation_split`` under two strategies (``keras3_jax_weights``)."""
    return keras3_jax_weights.cases(client)


def find_spec(_client, _workdir):
    """How this process started: daskdist, ``find_spec("keras")``, then ``import keras`` (wrapped by that import)."""
    return {**FIND_SPEC_THEN_IMPORT, "backend": keras.backend.backend()}


#: Every scenario; those in ``NO_SHARED_CLUSTER`` need no workers or start their own, the others share one
#: threaded cluster.
SCENARIOS = {"find_spec": find_spec, "spmd": spmd, "held": held, "weights": weights, "elastic": elastic,
             "matrix": matrix}
NO_SHARED_CLUSTER = ("find_spec", "elastic", "matrix")


def run(names, workdir, n_workers=3, seconds=None) -> dict:
    """Run the scenarios ``names`` in this order: ``{name: result}``, or ``{name: {"error": traceback}}``.

    ``seconds``: a dict that gets each scenario's wall and CPU seconds (this process's) as ``[wall, cpu]``.
    """
    results: dict = {}
    with contextlib.ExitStack() as stack:
        shared: list[Client] = []  # the threaded cluster, started for the first scenario that shares it

        def client() -> Client:
            if not shared:
                cluster = stack.enter_context(LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=False,
                                                           dashboard_address=":0", silence_logs=logging.ERROR))
                shared.append(stack.enter_context(Client(cluster, set_as_default=False)))
            return shared[0]

        for name in names:
            scenario_dir = os.path.join(workdir, name)
            os.makedirs(scenario_dir, exist_ok=True)
            started = time.monotonic(), time.process_time()
            try:
                results[name] = SCENARIOS[name](None if name in NO_SHARED_CLUSTER else client(), scenario_dir)
            except Exception:  # noqa: BLE001 (reported: the test of this scenario fails with it, the others run)
                results[name] = {"error": traceback.format_exc()[-5000:]}
            if seconds is not None:
                seconds[name] = [round(time.monotonic() - started[0], 2), round(time.process_time() - started[1], 2)]
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args(argv)
    seconds: dict = {}
    result = {"scenarios": run(args.scenarios, args.workdir, args.workers, seconds),
              "backend": keras.backend.backend(), "seconds": seconds}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
