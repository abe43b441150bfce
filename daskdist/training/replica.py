"""What an adapter's model resident on a replica gives the trainer (``ReplicaModel``).

The trainer's replica commands (``training.commands``) and its step loop
(``training.loop``) drive a model only through these methods; the adapter's
resident (``daskdist.keras.trainable.BuiltinTrainable``,
``daskdist.plugins.keras3.resident.KerasTrainable``) implements them beside
the training contract's ``Trainable`` (``train_step``, ``join_step``), which
the step driver calls inside ``train_batch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import StepDriver

__all__ = ["ReplicaModel"]


@runtime_checkable
class ReplicaModel(Protocol):
    """A model installed on a replica, as the trainer's commands run it."""

    def set_learning_rate(self, learning_rate: float | None) -> None:
        """The client's learning rate for the coming steps (``None``: keep the model's own, a schedule)."""

    def begin_loop(self, loop: str, timer: Any) -> None:
        """A ``"train"`` or ``"test"`` loop begins: the metrics (and loss totals) start from zero; ``timer``:
        the replica's step timer (``add_apply``: the apply phase of a step), or ``None``."""

    def end_loop(self, loop: str) -> None:
        """The loop is closed (its timer no longer used)."""

    def train_batch(self, batch: Any, driver: StepDriver) -> int:
        """One training step over a local batch with the step driver (``driver.step``); its local rows."""

    def test_batch(self, batch: Any) -> int:
        """One evaluation step over a local batch (the metrics updated); its local rows."""

    def global_logs(self, loop: str) -> dict[str, float]:
        """The ``loop``'s logs over every replica's rows so far (a collective: every replica calls it)."""

    def progress_logs(self) -> dict[str, float] | None:
        """Running logs to show while an epoch runs, known without a collective, or ``None``."""

    def end_train(self) -> None:
        """An epoch's steps are done (a collective: moving statistics averaged over the replicas, say)."""

    def step_count(self) -> int:
        """The optimizer's step count (a test's fault point numbers steps with it)."""

    def snapshot(self) -> dict[str, Any]:
        """The model's state, as the client takes it back and an elastic commit keeps it."""

    def weights(self) -> list[Any]:
        """The model's weights as numpy arrays (copies), in the order the framework's ``get_weights`` gives them."""
