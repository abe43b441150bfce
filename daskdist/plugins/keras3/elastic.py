"""``fit`` of a Keras 3 model on an elastic strategy: epochs in committed steps, recovered after a loss.

The client's side, an ``ElasticSession`` (``daskdist.elastic.session``) as
the built-in layers' ``fit`` is: ``EpochInput`` fixes each epoch's row order
and plans the rest of an epoch over whatever members are left, the replicas
commit every ``commit_every`` steps and at the end of each epoch
(``training.elastic.elastic_train_epoch``: ``commit_now`` snapshots every resident,
the model's ``KerasTrainable`` with its optimizer state and the epoch's
metric totals), and after a loss the session re-forms the group and puts
every member back at the newest commit all of them hold. The epoch then goes
on from that step with the same global batches, split over the members left,
so the weights are those of an uninterrupted run (the SPMD step driver's
gradient is that of the global batch whatever its split), and the ledger
holds every row of every epoch once. A loss while ``fit`` installs the model
(before anything is committed) re-forms the group and installs it again on
the members left (``ElasticSession.prepare``).

Membership changes at commits, as for the built-in layers
(``ElasticSession.change``): a group below ``min_replicas`` is refilled
at the start; free workers join at the start of each ``fit``, at each epoch
boundary and at a commit mid-epoch (replica 0 looks every ``admit_every``),
up to ``max_replicas``; members the scheduler retires (``retire_workers``,
a worker's lifetime) leave at the next commit, nothing rolled back and no
failure counted. The replicas stop at that commit
(the epoch command answers ``{"stopped_at": step}``), the
group changes, and the epoch goes on from that step over the new members. A
newcomer is given the model (``install_newcomer``), then the commit.
"""

from __future__ import annotations

import logging
from typing import Any

from daskdist.data.dataset import Dataset
from daskdist.elastic.options import ElasticOptions
from daskdist.elastic.recovery import RECOVERABLE
from daskdist.elastic.replica import commit_keys, commit_now
from daskdist.plugins.keras3 import commands
from daskdist.plugins.keras3.backend import keras_backend
from daskdist.plugins.keras3.payload import pack_model
from daskdist.training.elastic import ElasticRunner

__all__ = ["KerasElasticFit"]

logger = logging.getLogger(__name__)


class KerasElasticFit(ElasticRunner):
    """One elastic ``fit`` of a Keras 3 model (the trainer's ``ElasticRunner``: its epochs, ledger, recoveries).

    Parameters
    ----------
    model
        The client's Keras model (recorded in the strategy's scope).
    record
        Its record (``registry.Record``): the strategy and the replicas' copy's id.
    dataset
        The training data as a batched ``daskdist.data.Dataset`` (the global batch).
    options
        The strategy's ``ElasticOptions``.
    """

    def __init__(self, model: Any, record: Any, dataset: Dataset, options: ElasticOptions):
        super().__init__(record.strategy, options, dataset)
        self.model = model
        self.record = record
        self.fit_id = 0
        self.model_id = record.object_id
        self.with_state = True  # the client's model takes replica 0's state after each epoch

    # -- epochs ---------------------------------------------------------------------

    def take_first_commit(self, epoch: int) -> None:
        """A commit every member can go back to before the first step, newer than any commit they hold."""
        while True:
            try:
                held = self.group.call(commit_keys)
                self.fit_id = 1 + max((int(key[0]) for keys in held for key in keys), default=0)
                self.group.call(commit_now, ((self.fit_id, epoch, 0),))
                return
            except RECOVERABLE as error:
                self.recover(error)

    def install_newcomer(self, rank: int) -> None:
        """Give a newcomer the model, and every other model of the scope the members hold (a commit restores
        them all: their weights and optimizer states then come with it)."""
        import keras

        from daskdist.plugins.keras3 import registry

        models = [(self.model, self.record)] + [
            (obj, record) for obj, record in registry.items()
            if obj is not self.model and isinstance(obj, keras.Model) and record.fingerprint is not None
            and record.strategy is self.record.strategy]
        for model, record in models:
            payload = pack_model(model, keras_backend())
            self.extended.run_on_replica(rank, commands.install_model, (record.object_id, payload))
