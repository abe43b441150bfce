"""How a built-in ``Model`` reaches the trainer: the runner its ``fit``, ``evaluate`` and ``predict`` speak to.

``for_model(model, callbacks)`` asks the trainer which runner
(``training.runner_choice.choose_runner``, Keras 3's choice too) and gives
the model's side of it: under ParameterServerStrategy the trainer's
coordinator closures (``keras.ps_fit.PsModelRunner`` over
``training.ps.ClosureRunner``), else ``ReplicaModelRunner``: the trainer's
``ReplicaRunner`` on the replicas (one command per epoch, or stepwise with
the per-batch callbacks between), its ``ElasticRunner`` on an elastic
strategy (``keras.elastic_fit``), or the client's loop for a model made
outside every scope. What is the built-in layers' own here is the data
(``Model._as_dataset``), the progress topic's subscription and the model's
side of the copies' weights (the trainer's ``model_weights`` command reads
them).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist.arrays import to_numpy
from daskdist.group.service import MODEL, ReplicaService
from daskdist.keras import ps_fit, training
from daskdist.keras.callbacks import ProgbarLogger, is_default
from daskdist.keras.trainable import BuiltinTrainable
from daskdist.training.commands import model_weights
from daskdist.training.fit import EpochRunner
from daskdist.training.progress import PROGRESS_TOPIC
from daskdist.training.runner_choice import RunnerChoice, RunnerKind, choose_runner
from daskdist.training.runners import ReplicaRunner, hooked_callbacks

if TYPE_CHECKING:
    from daskdist.strategy.base import Strategy
    from daskdist.strategy.drivers.contract import StepDriver

__all__ = ["ReplicaModelRunner", "for_model", "hooked"]


def hooked(callbacks: Sequence[Any] | None) -> Callable[[str], list[str]]:
    """``hooked(loop)`` for the trainer's ``choose_runner``: the user's ``callbacks`` (not the progress bar) that
    override a per-batch hook of ``loop``, by class name."""
    users = [cb for cb in callbacks or [] if not isinstance(cb, ProgbarLogger)]
    return lambda loop: hooked_callbacks(users, loop, is_default)


def for_model(model: Any, callbacks: Sequence[Any] | None = None, *,
              training: bool = False) -> ReplicaModelRunner | ps_fit.PsModelRunner:
    """The runner of ``model``'s ``fit`` (``training``, with the user's ``callbacks``) or of its evaluation,
    prediction and weights, as the trainer chooses it (``choose_runner``)."""
    choice = choose_runner(model._strategy, hooked(callbacks), training=training)
    if choice.kind is RunnerKind.CLOSURES:
        return ps_fit.PsModelRunner(model)
    return ReplicaModelRunner(model, choice)


class ReplicaModelRunner:
    """Runs epochs of a model: on the replicas (one command per epoch, the strategy's step driver) or here.

    The runner interface ``Model.fit``/``evaluate``/``predict`` speak
    (``ps_fit.PsModelRunner`` is the other one): ``begin_fit``, ``steps``,
    ``begin``, ``run_epoch``, ``validate``, ``evaluate``, ``predict``,
    ``close``. The epochs themselves are the trainer's: ``training.runners.ReplicaRunner``,
    ``training.elastic.ElasticRunner`` (``keras.elastic_fit.ElasticFit``), or the client's loop
    (``keras.training.train_batches``) for a model without a strategy.
    """

    def __init__(self, model: Any, choice: RunnerChoice):
        self.model = model
        self.choice = choice
        self.distributed = choice.kind is not RunnerKind.LOCAL
        self.train: Any = None  # the fit's training dataset
        self._val: Any = None
        self.dist_train: Any = None  # the training dataset distributed over the replicas
        self._dist_val: Any = None
        self.tag = uuid.uuid4().hex[:8]  # the fit's progress events carry it
        self._subscribed = False
        self._elastic: Any = None  # ``keras.elastic_fit.ElasticFit`` during a fit on an elastic strategy
        self.recoveries: list[Any] = []  # elastic: the group re-formed while the model was installed (``Recovery``)
        self.failures = 0  # elastic: the losses among them (counted against ``max_failures``)

    @property
    def strategy(self) -> Strategy:
        """The model's strategy (the runner of a distributed model; a local one has none)."""
        strategy: Strategy | None = self.model._strategy
        if strategy is None:
            raise RuntimeError(f"model {self.model.name!r} was created outside any strategy's scope: it trains here")
        return strategy

    def begin_fit(self, x: Any, y: Any, batch_size: int | None, shuffle: bool, validation_data: Any,
                  callbacks: list[Any] | None, steps_per_epoch: int | None) -> None:
        """The fit's data, distributed over the replicas (the model installed there first)."""
        model = self.model
        train = model._as_dataset(x, y, batch_size, shuffle)
        val = None
        if isinstance(validation_data, tuple):
            if len(validation_data) not in (1, 2):
                raise ValueError(f"validation_data must be a Dataset, (x,) or (x, y) (no sample weights); got a "
                                 f"tuple of {len(validation_data)}")
            val_x, val_y = (*validation_data, None)[:2]
            val = model._as_dataset(val_x, val_y, batch_size=batch_size, shuffle=False)
        elif validation_data is not None:
            val = model._as_dataset(validation_data, None, batch_size, False)
        self._prepare(train, val)

    def _prepare(self, train: Any, val: Any) -> None:
        self.train, self._val = train, val
        if not self.distributed:
            return
        options = self.choice.elastic
        if options is None:
            self._distribute(train, val)
            return
        from daskdist.elastic.session import prepare_members

        # members that left while the group ran nothing are learnt first; a loss meanwhile re-forms the group
        # and the members left get the model and the data again. The training data is not distributed here:
        # the elastic fit plans each epoch's rest itself (``elastic.epochs.EpochPlans``)
        self.recoveries, self.failures = prepare_members(self.strategy, options,
                                                         lambda: self._distribute(None, val))
        if train is not None:
            from daskdist.keras.elastic_fit import ElasticFit

            self._elastic = ElasticFit(self, options)

    def _distribute(self, train: Any, val: Any) -> None:
        """The model installed on the replicas (if it is not), the fit's data distributed over them."""
        model = self.model
        model._ensure_installed()
        strategy = self.strategy
        if train is not None:
            self.dist_train = strategy.experimental_distribute_dataset(train)
        if val is not None:
            self._dist_val = val if val is train else strategy.experimental_distribute_dataset(val)

    def validate(self, batch_size: int | None, steps: int | None) -> dict[str, float] | None:
        """The validation logs of the epoch just trained, or ``None`` without validation data."""
        return None if self._val is None else self.evaluate_dataset(self._val, steps)

    def evaluate(self, x: Any, y: Any, batch_size: int | None, steps: int | None) -> dict[str, float]:
        data = self.model._as_dataset(x, y, batch_size, False, what="evaluate")
        self._prepare(None, data)
        return self.evaluate_dataset(data, steps)

    def predict(self, x: Any, batch_size: int | None) -> np.ndarray:
        """Outputs computed in this process with the current weights (replica 0's, for a distributed model)."""
        local = self.model._local_copy()
        data = self.model._as_dataset(x, None, batch_size or 32, False, what="predict")
        return to_numpy(training.predict_batches(local, iter(data)))

    # -- the copies that compute (replica 0's; every replica's when set) ---------------------------

    def computed_weights(self) -> list[np.ndarray]:
        weights: list[np.ndarray] = self.strategy.extended.run_on_replica(0, model_weights, (self.model._model_id,))
        return weights

    def set_computed_weights(self, weights: list[np.ndarray]) -> None:
        self.strategy.extended.run_on_replicas(_replica_set_weights, (self.model._model_id, weights))

    def computed_optimizer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.strategy.extended.run_on_replica(0, _replica_optimizer_state,
                                                                      (self.model._model_id,))
        return state

    def set_computed_optimizer_state(self, state: dict[str, Any]) -> None:
        self.strategy.extended.run_on_replicas(_replica_set_optimizer_state, (self.model._model_id, state))

    def driver(self) -> StepDriver:
        """The strategy's step driver for this model (its parameters named by the model's id)."""
        return self.strategy.extended.step_driver(self.model._model_id)

    def steps(self) -> int | None:
        """The steps of an epoch as planned (``None``: not known before reading it)."""
        if self._elastic is not None:
            return int(self._elastic.input.steps_from(0, self.strategy.num_replicas_in_sync))
        if self.dist_train is not None:
            steps = [s for s in self.dist_train.plan().steps_per_replica() if s is not None]
            return max(steps) if steps else None
        return None

    def begin(self, epoch: int) -> None:
        """The fit's first epoch is ``epoch``: on an elastic strategy (``ElasticOptions``), this fit's epochs
        run as the trainer's elastic epochs (``keras.elastic_fit.ElasticFit``, made by ``begin_fit``)."""
        if self._elastic is None:
            return
        if self.model.history is not None:  # the fit's History (its ``elastic_events`` follow the session's)
            self.model.history.elastic = self._elastic
            self._elastic.history = self.model.history
        self._elastic.begin(epoch)

    def run_epoch(self, epoch: int, steps: int | None, cb: Any) -> dict[str, float]:
        """One epoch where the model trains: the trainer's runner on the replicas (elastic or not), or here."""
        model = self.model
        if not self.distributed:
            return training.train_batches(model, iter(self.train), steps, cb.on_progress)
        self._subscribe(cb)
        if self._elastic is not None:
            self._elastic.set_callbacks(cb)  # a growth at the fit's start, before the callbacks were known: told now
        planned = steps if steps is not None or self._elastic is not None else self.steps()
        results = self._epochs().train_epoch(
            epoch, self.dist_train, steps, self.driver(), lambda: float(model.optimizer.learning_rate), self.tag,
            callbacks=cb, steps=planned, size=model._steps_per_execution, stopped=lambda: bool(model.stop_training))
        return dict(results["logs"])

    def _replicas(self) -> ReplicaRunner:
        """The trainer's runner of this model's epochs and evaluations on the replicas."""
        return ReplicaRunner(self.strategy.extended, self.model._model_id, with_state=False)

    def _epochs(self) -> EpochRunner:
        """The trainer's runner of this fit's epochs and validations (elastic ones once ``begin`` made them so)."""
        return EpochRunner(self.choice, self._replicas(), self._elastic)

    def replan_validation(self) -> None:
        """Distribute the validation data again at its next use (the members changed)."""
        self._dist_val = None

    def evaluate_dataset(self, data: Any, steps: int | None) -> dict[str, float]:
        """An evaluation of ``data``: an elastic fit's validation runs again on the members left after a loss."""
        if self._elastic is not None:
            return self._epochs().evaluate(lambda: self._distributed_validation(data), steps)
        if not self.distributed:
            return training.evaluate_batches(self.model, iter(data), steps)
        return self._replicas().evaluate(self._distributed_validation(data), steps)

    def _distributed_validation(self, data: Any) -> Any:
        """``data`` distributed over the current members (again after a change: ``replan_validation``), the model
        installed there first."""
        self.model._ensure_installed()
        if self._dist_val is None:
            self._dist_val = self.strategy.experimental_distribute_dataset(data)
        return self._dist_val

    def _subscribe(self, cb: Any) -> None:
        if self._subscribed or not cb.wants_progress():
            return
        client = self.strategy.client
        tag = self.tag

        def handler(event: tuple[float, Any]) -> None:
            _, msg = event
            if msg.get("tag") == tag:
                cb.on_progress(msg["step"], msg.get("logs", {}))

        client.subscribe_topic(PROGRESS_TOPIC, handler)
        self._subscribed = True

    def close(self) -> None:
        if self._subscribed:
            try:
                self.strategy.client.unsubscribe_topic(PROGRESS_TOPIC)
            except Exception:  # pragma: no cover - the client may be closing
                pass


# -- commands that run on the replicas ---------------------------------------------------


def _replica_trainable(service: ReplicaService, model_id: str) -> BuiltinTrainable:
    installed: BuiltinTrainable = service.objects.get(MODEL, model_id)
    return installed


def _replica_model(service: ReplicaService, model_id: str) -> Any:
    return _replica_trainable(service, model_id).model


def _replica_set_weights(service: ReplicaService, model_id: str, weights: list[np.ndarray]) -> None:
    model = _replica_model(service, model_id)
    model._require_built()
    model._assign_weights(weights)


def _replica_optimizer_state(service: ReplicaService, model_id: str) -> dict[str, np.ndarray]:
    return {k: to_numpy(v) for k, v in _replica_model(service, model_id).optimizer.get_state().items()}


def _replica_set_optimizer_state(service: ReplicaService, model_id: str, state: dict[str, Any]) -> None:
    _replica_model(service, model_id).optimizer.set_state(state)
