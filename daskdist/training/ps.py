"""Fit, evaluation and prediction under ParameterServerStrategy: coordinator closures, written once.

TensorFlow's rules for Keras under its ``ParameterServerStrategy`` (Keras'
``_ClusterCoordinatorDataHandler``, the ``parameter_server_training``
tutorial), for every adapter:

* each worker keeps its own copy of the model, installed as its resident
  ``(MODEL, model id)``: a ``PsWorker`` (the adapter's subclass: its
  ``Trainable``, the strategy's ``PsStepDriver``, and a few hooks);
* an epoch is ``steps_per_epoch`` steps cut into closures of
  ``steps_per_execution`` steps (``chunks``), each scheduled through the
  strategy's ``ClusterCoordinator`` on whichever worker is free
  (``ClosureRunner.train_epoch``): a closure pulls the parameters changed on
  the stores, runs its steps (each step's gradients pushed to the stores,
  applied there once) and assigns its state (moving statistics) on the stores
  as it ends (``PsStepDriver.end``: the last writer's kept); the client sums
  the closures' results (the adapter's ``aggregate``) and, after the epoch,
  its model takes the stored parameters, slots and state (the adapter's
  ``after_epoch``);
* an evaluation (``plan_evaluation``): a per-worker dataset read ``steps``
  batches at a time (TF's at-least-once visitation), or every row exactly
  once: finite data cut into ``evaluation_shards`` shards, one closure each,
  only the last run of a closure counted (TF's ``pss_evaluation_shards``);
  batches cut on the client travel in the closures;
* ``predict`` (``ClosureRunner.predict``): the input cut into pieces, each a
  closure on a worker with the parameters stored now, the outputs put back in
  order on the client;
* a parameter server's loss, whichever call meets it first, is raised as
  ``ParameterServerLostError`` (``parameter_servers_lost_as_such``).

A custom loop's closures (a user's function scheduled through the
coordinator, using the model) are not a runner: the user's loop drives them.
The worker's side is here (``PsWorker.custom_closure_began``, ``apply_gradients``):
the stored parameters pulled as the closure starts, each step's gradients
pushed, the held state written back as it ends when the closure changed it.

The adapter's hook surface is small: ``PsWorker``'s ``in_replica``,
``prepare``, ``results`` and ``predict_batch`` on the workers; the client's
``aggregate`` (the closures' results into the epoch's logs) and
``after_epoch`` (the client's copy takes the stored state).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np

from daskdist import context
from daskdist.arrays import to_numpy
from daskdist.group.service import MODEL, ReplicaService

__all__ = ["AUTO_SHARDS_PER_WORKER", "ClosureRunner", "PsWorker", "chunks", "evaluation_pieces", "evaluation_shards",
           "parameter_servers_lost_as_such", "plan_evaluation", "predict_pieces", "worker_model"]

#: Evaluation shards per worker when the setting is ``"auto"`` (or 0, or ``None``).
AUTO_SHARDS_PER_WORKER = 4

_Result = TypeVar("_Result")  # what a closure's work returns


# -- the workers -----------------------------------------------------------------------------------


class PsWorker:
    """A parameter-server worker's copy of a model and the ``PsStepDriver`` that trains it (its resident).

    ``trainable`` is the adapter's (a ``training.replica.ReplicaModel`` and a
    held ``Trainable``). The adapter's subclass gives ``results`` (what a
    closure returns for the client to sum) and ``predict_batch``; it may give
    ``in_replica`` (run a closure's work in the worker's replica context) and
    ``prepare`` (the model made ready for a first batch before the parameters
    are pulled).
    """

    def __init__(self, trainable: Any, driver: Any):
        self.trainable = trainable
        self.driver = driver
        self.predicted = 0  # batches this worker predicted (how far ``predict``'s work spread over the workers)
        self._pulled_state: list[np.ndarray] = []  # the held state as a custom loop's closure pulled it

    # -- the adapter's hooks ------------------------------------------------------------------

    def in_replica(self, work: Callable[..., _Result], *args: Any) -> _Result:
        """Run ``work(*args)`` where a closure's steps run (default: here)."""
        return work(*args)

    def prepare(self, batch: Any) -> None:
        """Before the first evaluated or predicted batch pulls the parameters (default: nothing)."""

    def results(self, loop: str, batch: Any) -> dict[str, Any]:
        """What a ``"train"`` or ``"test"`` closure returns (sums the client adds up); ``batch``: its last one."""
        raise NotImplementedError

    def predict_batch(self, batch: Any) -> Any:
        """The model's outputs for one batch (inputs only, or a tuple whose first part is the inputs), as numpy."""
        raise NotImplementedError

    # -- the closures' work -------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        state: dict[str, Any] = self.trainable.snapshot()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        self.trainable.restore(state)

    def train(self, iterator: Iterator[Any], steps: int, learning_rate: float | None) -> dict[str, Any]:
        """``steps`` training steps on this worker's iterator; the state assigned on the stores at the end."""
        trainable, driver = self.trainable, self.driver
        trainable.set_learning_rate(learning_rate)
        trainable.begin_loop("train", None)
        driver.begin(trainable)
        batch: Any = None
        try:
            for _ in range(steps):
                batch = next(iterator)
                trainable.train_batch(batch, driver)
            driver.end(trainable)  # the moving statistics assigned on the stores (the last writer's kept)
        finally:
            trainable.end_loop("train")
        return self.results("train", batch)

    def _pulled(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, the stored parameters (and state) pulled before the first one."""
        pulled = False
        for batch in batches:
            if not pulled:
                self.prepare(batch)
                self.driver.begin(self.trainable)
                self.driver.pull(self.trainable)
                pulled = True
            yield batch

    def evaluate(self, batches: Iterable[Any]) -> dict[str, Any]:
        """The loss and metrics over ``batches`` with the parameters stored now (sums: ``results``)."""
        self.trainable.begin_loop("test", None)
        batch: Any = None
        try:
            for batch in self._pulled(batches):
                self.trainable.test_batch(batch)
        finally:
            self.trainable.end_loop("test")
        return self.results("test", batch)

    def predict(self, batches: Iterable[Any]) -> list[Any]:
        """The outputs for ``batches``, one array per batch, with the parameters stored now."""
        outputs = [self.predict_batch(batch) for batch in self._pulled(batches)]
        self.predicted += len(outputs)
        return outputs

    # -- a custom loop's closures (the user's function, ``ClusterCoordinator.schedule``) ----------------
    #
    # Not a runner: the user's function is the step and the user's loop schedules it; what the trainer gives is
    # this worker's side of it. The adapter resolves a reference to the model in the function to this
    # worker's copy and calls ``custom_closure_began``; its optimizer's ``apply`` calls ``apply_gradients``.

    def custom_closure_began(self, service: ReplicaService) -> None:
        """A scheduled function met a reference to this model: pull what the others pushed meanwhile; when the
        closure returns, the held state it changed (moving statistics) is assigned on the stores
        (``custom_closure_ended``)."""
        from daskdist.ps.closures import at_closure_end

        self.driver.begin(self.trainable)
        self.driver.pull(self.trainable)
        self._pulled_state = self._held_copies()
        at_closure_end(service, f"training/held-state/{id(self)}", self.custom_closure_ended)

    def custom_closure_ended(self) -> None:
        """The closure returned: the held state (a forward pass with ``training=True`` changes the moving
        statistics) is assigned on the stores, as ``fit``'s closures assign it (``PsStepDriver.end``: the last
        writer's kept); a closure that changed none (it only read the model) writes nothing, so it cannot undo
        another worker's newer state."""
        if any(not np.array_equal(a, b) for a, b in zip(self._held_copies(), self._pulled_state)):
            self.driver.end(self.trainable)

    def apply_gradients(self, gradients: list[Any]) -> None:
        """A custom loop's step: the gradients of every trainable parameter, in the trainable's order, pushed to
        the stores (applied there once) and the new parameters assigned here."""
        self.driver.apply_gradients(self.trainable, gradients)

    def _held_copies(self) -> list[np.ndarray]:
        held = getattr(self.trainable, "held_state", None)
        return [np.array(to_numpy(value), copy=True) for value in (held() if held is not None else [])]


def worker_model(model_id: str) -> Any:
    """On a worker running a closure: the model resident ``model_id`` (a ``PsWorker``)."""
    service = context.current_runtime()
    if service is None:
        raise RuntimeError("Keras closures run on ParameterServerStrategy workers only")
    return service.objects.get(MODEL, model_id)


def install_worker(service: ReplicaService, model_id: str, worker: PsWorker) -> None:
    """Worker command: keep a fresh copy of ``worker`` as the resident ``(MODEL, model_id)``."""
    service.objects.install(MODEL, model_id, copy.deepcopy(worker))


def train_closure(model_id: str, iterator: Any, steps: int, learning_rate: float | None) -> dict[str, Any]:
    """A ``fit`` closure: ``steps`` steps on this worker's iterator."""
    worker: PsWorker = worker_model(model_id)
    return worker.in_replica(worker.train, iterator, steps, learning_rate)


def evaluate_closure(model_id: str, iterator: Any, steps: int) -> dict[str, Any]:
    """An at-least-once evaluation closure: ``steps`` batches of this worker's iterator (a per-worker dataset)."""
    worker: PsWorker = worker_model(model_id)
    return worker.in_replica(worker.evaluate, itertools.islice(iterator, steps))


def evaluate_piece(model_id: str, piece: Iterable[Any]) -> dict[str, Any]:
    """An exactly-once evaluation closure: the batches it carries, or a ``Dataset`` shard read to its end."""
    worker: PsWorker = worker_model(model_id)
    return worker.in_replica(worker.evaluate, iter(piece))


def evaluate_shard(model_id: str, data: Any, shards: int, index: int) -> dict[str, Any]:
    """An exactly-once evaluation closure: shard ``index`` of ``shards`` (by batch) of a ``DatasetCreator``'s
    dataset for one input pipeline, built on this worker and read to its end."""
    worker: PsWorker = worker_model(model_id)
    return worker.in_replica(worker.evaluate, iter(_pipeline(data).shard(shards, index)))


def predict_closure(model_id: str, piece: Iterable[Any]) -> list[Any]:
    """A ``predict`` closure: the outputs for the batches of ``piece``, in order."""
    worker: PsWorker = worker_model(model_id)
    return worker.in_replica(worker.predict, iter(piece))


# -- the client ------------------------------------------------------------------------------------


def chunks(steps: int, size: int) -> list[int]:
    """``steps`` cut into closures of ``size`` steps (``steps_per_execution``), the last one shorter."""
    return [min(size, steps - start) for start in range(0, steps, size)]


def check_steps_per_epoch(steps_per_epoch: int | None, strategy_name: str) -> int:
    """TF's rule: ``steps_per_epoch`` is required (and at least 1) under ParameterServerStrategy."""
    if steps_per_epoch is None:
        raise ValueError(f"`steps_per_epoch` must be specified with `{strategy_name}`.")
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    return steps_per_epoch


class ClosureRunner:
    """The client's side of a model's epochs, evaluations and predictions in coordinator closures.

    Parameters
    ----------
    coordinator
        The strategy's ``ClusterCoordinator``.
    model_id
        The model's resident id on the workers (a ``PsWorker``).
    extended
        The strategy's Extended (its parameter servers, for ``parameter_servers_lost_as_such``).
    """

    def __init__(self, coordinator: Any, model_id: str, extended: Any):
        self.coordinator, self.model_id, self.extended = coordinator, model_id, extended

    def train_epoch(self, iterator: Any, steps: int, size: int, learning_rate: float | None,
                    aggregate: Callable[[list[dict[str, Any]]], dict[str, float]],
                    after_epoch: Callable[[], None] = lambda: None) -> dict[str, float]:
        """``steps`` steps in closures of ``size`` steps on whichever worker is free; the epoch's logs.

        ``aggregate(results)``: the closures' results (each committed closure's once) summed into the logs;
        ``after_epoch()``: the client's copy takes the stored parameters and state.
        """
        coordinator = self.coordinator
        with parameter_servers_lost_as_such(self.extended):
            values = [coordinator.schedule(train_closure, args=(self.model_id, iterator, n, learning_rate))
                      for n in chunks(steps, size)]
            coordinator.join()
            logs = aggregate(coordinator.fetch(values))
            coordinator.done()  # a parameter server's loss the coordinator already knows: raised now
            after_epoch()
        return logs

    def evaluate(self, plan: Callable[[], list[Any]],
                 aggregate: Callable[[list[dict[str, Any]]], dict[str, float]]) -> dict[str, float]:
        """The closures ``plan()`` schedules (``plan_evaluation``), joined; their results summed (``aggregate``)."""
        with parameter_servers_lost_as_such(self.extended):
            values = plan()
            self.coordinator.join()
            return aggregate(self.coordinator.fetch(values))

    def predict(self, pieces: list[Any]) -> list[Any]:
        """Each piece (a list of batches, or a ``Dataset`` shard) predicted in one closure; the outputs of every
        batch, in the pieces' order."""
        with parameter_servers_lost_as_such(self.extended):
            values = [self.coordinator.schedule(predict_closure, args=(self.model_id, piece)) for piece in pieces]
            self.coordinator.join()
            return [output for outputs in self.coordinator.fetch(values) for output in outputs]


def predict_pieces(batches: list[Any], pieces: int) -> list[list[Any]]:
    """``batches`` cut into at most ``pieces`` runs of consecutive batches (one ``predict`` closure each)."""
    count = max(1, min(pieces, len(batches)))
    bounds = [round(i * len(batches) / count) for i in range(count + 1)]
    return [batches[bounds[i]:bounds[i + 1]] for i in range(count) if bounds[i] < bounds[i + 1]]


def evaluation_shards(setting: Any, workers: int, name: str = "pss_evaluation_shards") -> int:
    """The shards of an exactly-once evaluation: ``setting`` (``"auto"``, 0 or ``None``: 4 per worker)."""
    if setting in (0, "auto", None):
        return AUTO_SHARDS_PER_WORKER * max(workers, 1)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"{name} must be an int >= 1 or 'auto', got {setting!r}")
    return setting


def plan_evaluation(coordinator: Any, model_id: str, data: Any, steps: int | None, size: int, shards: Any,
                    steps_name: str = "steps") -> Callable[[], list[Any]]:
    """What one evaluation schedules: a function returning its closures' ``RemoteValue``s.

    ``data``: a list of batches cut on the client (closures of ``size`` batches, each row once); a
    ``DatasetCreator``, a ``dataset_fn(input_context)`` or a ``Dataset``: with ``steps``, each worker
    reads ``steps`` batches of its own (TF's at-least-once visitation), without, every row once, in
    ``evaluation_shards(shards, workers)`` shards (``shards``: the adapter's setting).

    Raises
    ------
    ValueError
        ``steps`` below 1; data read exactly once that never ends or changes between reads
        (``check_exact``), naming ``steps_name`` as the other way.
    """
    from daskdist.data.dataset import Dataset
    from daskdist.data.dataset_creator import DatasetCreator

    if isinstance(data, list):
        groups = [data[i:i + size] for i in range(0, len(data), size)]
        return lambda: [coordinator.schedule(evaluate_piece, args=(model_id, group)) for group in groups]
    if steps is not None:
        if steps < 1:
            raise ValueError(f"{steps_name} must be >= 1, got {steps}")
        per_worker = coordinator.create_per_worker_dataset(
            data if isinstance(data, (DatasetCreator, Dataset)) else DatasetCreator(data))

        def on_workers() -> list[Any]:
            iterator = iter(per_worker)  # each evaluation reads the workers' datasets from their start
            return [coordinator.schedule(evaluate_closure, args=(model_id, iterator, n)) for n in chunks(steps, size)]

        return on_workers
    check_exact(_pipeline(data), steps_name)
    count = evaluation_shards(shards, len(coordinator.live_workers))
    if isinstance(data, Dataset):
        pieces = evaluation_pieces(data, count)
        return lambda: [coordinator.schedule(evaluate_piece, args=(model_id, piece)) for piece in pieces]
    return lambda: [coordinator.schedule(evaluate_shard, args=(model_id, data, count, k)) for k in range(count)]


def check_exact(dataset: Any, steps_name: str) -> None:
    """Refuse, before anything runs, a dataset that cannot be read exactly once in shards (see ``plan_evaluation``)."""
    from daskdist.data import ops

    for op in dataset.transformations:
        if isinstance(op, ops.Repeat):
            raise ValueError(f"evaluating every row once reads the dataset to its end, and it repeats: drop repeat() "
                             f"from the evaluation data, or give `{steps_name}` (each worker then reads its own)")
        if isinstance(op, ops.Shuffle) and op.seed is None:
            raise ValueError("evaluating every row once needs the same rows in the same batches in every closure: "
                             f"give the evaluation data's shuffle() a seed (or none), or give `{steps_name}`")


def evaluation_pieces(data: Any, shards: int) -> list[Any]:
    """A finite ``Dataset`` cut into ``shards`` pieces: whole partitions of a Dask collection (each read once),
    else shards by batch (``Dataset.shard``)."""
    from daskdist.data import ops
    from daskdist.data.dataset import Dataset
    from daskdist.data.sources import DaskSource

    source = data.source
    if isinstance(source, DaskSource) and not any(isinstance(op, ops.Take) for op in data.transformations):
        count = min(shards, len(source.partitions))
        pieces = []
        for i in range(count):
            part = copy.copy(source)
            part.partitions = source.partitions[i::count]
            pieces.append(Dataset(part, data.transformations))
        return pieces
    return [data.shard(shards, i) for i in range(shards)]


def _pipeline(data: Any) -> Any:
    """The dataset for one input pipeline (every row): a ``Dataset`` itself, else ``dataset_fn(InputContext(1, 0))``."""
    from daskdist.data.dataset import Dataset
    from daskdist.training.fit_inputs import first_pipeline

    return data if isinstance(data, Dataset) else first_pipeline(data)


@contextlib.contextmanager
def parameter_servers_lost_as_such(extended: Any) -> Iterator[None]:
    """A ``ReplicaLostError`` of a lost parameter server (one named by the error, or the stores' group failed)
    raised as ``ParameterServerLostError``, the coordinator's error for it, whichever call met the loss first
    (a closure, or the client reading the stores)."""
    from daskdist.exceptions import ParameterServerLostError, ReplicaLostError

    try:
        yield
    except ParameterServerLostError:
        raise
    except ReplicaLostError as error:
        worker = getattr(error, "worker", None)
        if worker not in extended.ps_addresses and not _stores_failed(extended):
            raise
        raise ParameterServerLostError(f"a parameter server is lost; training cannot continue (restart from a "
                                       f"checkpoint with a new strategy): {error}", worker=worker) from error


def _stores_failed(extended: Any) -> bool:
    """Whether the scheduler failed the parameter servers' group (a ps left the cluster)."""
    group = extended.store_group
    try:
        return group is not None and group.status()[0] == "failed"
    except Exception:  # noqa: BLE001 - the client is closing: not known
        return False
