"""Which runner a ``fit`` or an evaluation runs on, chosen once for every adapter.

An adapter's ``fit`` (and ``evaluate``, ``predict``) asks ``choose_runner``
with the model's strategy and which of the user's callbacks override a
per-batch hook (``hooked(loop)``: their class names), and runs the kind it is
given; it probes the Extended for nothing itself. The choice reads the
Extended's capabilities, in this order:

* no strategy (a model made outside every scope), or the default
  one-replica strategy: ``LOCAL``, the adapter's own loop in the client process;
* ``extended.schedules_closures`` (ParameterServerStrategy): ``CLOSURES``,
  coordinator closures (``training.ps.ClosureRunner``); a callback with a
  per-batch training hook is refused there, as TensorFlow refuses it (the
  closures run asynchronously on whichever worker is free);
* ``extended.elastic`` (``ElasticOptions``): ``ELASTIC``, epochs in committed
  steps (``training.elastic.ElasticRunner``); a ``fit`` with a per-batch hook
  (training or test) is refused: an elastic epoch is one command between
  commits, which a recovery may run again;
* else ``STEPWISE`` when a callback has a per-batch training hook
  (``training.runners.ReplicaRunner``, ``steps_per_execution`` steps per
  command with the hooks between), else ``REPLICAS`` (one command per epoch).

An evaluation (``training=False``) is never refused: it runs as a ``fit``'s
validation would, stepwise when a callback has a per-batch test hook.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daskdist.strategy.extended.elastic_options import ElasticOptions

__all__ = ["RunnerChoice", "RunnerKind", "choose_runner", "no_hooks"]


class RunnerKind(enum.Enum):
    """Where a model's epochs run."""

    LOCAL = "local"  #: the client process (no strategy): the adapter's own loop
    REPLICAS = "replicas"  #: ``ReplicaRunner``, one command per epoch
    STEPWISE = "stepwise"  #: ``ReplicaRunner``, ``steps_per_execution`` steps per command, batch hooks between
    ELASTIC = "elastic"  #: ``ElasticRunner``, epochs in committed steps
    CLOSURES = "closures"  #: ``ClosureRunner``, coordinator closures on the parameter-server workers


@dataclass(frozen=True)
class RunnerChoice:
    """The runner a fit or an evaluation runs on.

    Attributes
    ----------
    kind
        Where the epochs run.
    per_batch_test
        Whether evaluations run stepwise, the per-batch test hooks between commands (replicas only).
    elastic
        The strategy's ``ElasticOptions`` when ``kind`` is ``ELASTIC``, else ``None``.
    """

    kind: RunnerKind
    per_batch_test: bool = False
    elastic: ElasticOptions | None = None

    @property
    def per_batch_train(self) -> bool:
        """Whether training runs stepwise (the per-batch training hooks between commands)."""
        return self.kind is RunnerKind.STEPWISE

    @property
    def on_replicas(self) -> bool:
        """Whether the epochs run on the strategy's replicas (plain, stepwise or elastic)."""
        return self.kind in (RunnerKind.REPLICAS, RunnerKind.STEPWISE, RunnerKind.ELASTIC)


def no_hooks(loop: str) -> Sequence[str]:
    """No callback has per-batch hooks (``choose_runner``'s default)."""
    return ()


def choose_runner(strategy: Any, hooked: Callable[[str], Sequence[str]] = no_hooks, *,
                  training: bool = True) -> RunnerChoice:
    """The runner of a ``fit`` (``training``) or an evaluation of a model of ``strategy`` (``None``: none).

    ``hooked(loop)``: the class names of the user's callbacks that override a per-batch hook of ``loop``
    (``"train"``, ``"test"``: ``training.runners.hooked_callbacks`` with the framework's ``is_default``).

    Raises
    ------
    ValueError
        A ``fit`` under coordinator closures with a callback that has a per-batch training hook (TensorFlow's
        error, naming the callbacks).
    NotImplementedError
        A ``fit`` on an elastic strategy with a callback that has a per-batch hook.
    """
    if strategy is None or getattr(strategy, "is_default_strategy", False):
        return RunnerChoice(RunnerKind.LOCAL)
    extended = strategy.extended
    if extended.schedules_closures:
        found = list(hooked("train")) if training else []
        if found:
            raise ValueError(f"Batch-level `Callback`s are not supported with `{type(strategy).__name__}`. Found: "
                             f"{found}. Their per-batch hooks (on_train_batch_begin/end, on_batch_begin/end) would "
                             "not run: use epoch-level hooks (on_epoch_begin/end)")
        return RunnerChoice(RunnerKind.CLOSURES)
    per_batch_test = bool(hooked("test"))
    options = extended.elastic
    if options is not None:
        found = sorted({*hooked("train"), *hooked("test")}) if training else []
        if found:
            raise NotImplementedError(
                f"per-batch callbacks (on_train_batch_*, on_test_batch_*) do not run under an elastic strategy yet: "
                f"an elastic epoch is one command between commits. Found: {found}; use epoch-level hooks "
                "(on_epoch_begin/end)")
        return RunnerChoice(RunnerKind.ELASTIC, per_batch_test, options)
    if training and hooked("train"):
        return RunnerChoice(RunnerKind.STEPWISE, per_batch_test)
    return RunnerChoice(RunnerKind.REPLICAS, per_batch_test)
