"""The built-in layers' side of an elastic ``fit``: the trainer's ``ElasticRunner`` plus the model's first commit.

The epochs are the trainer's (``daskdist.training.elastic``): commits every
``commit_every`` steps copied off the step's path and replayed, recovery
from the newest common commit after a loss, growth and retirement at
commits. What is the built-in layers' own: a model is built at its first
batch from replica 0's initial weights, so the first commit builds it first
(``take_commit`` with the input's shape); a newcomer is installed with the
model's ``resident()`` (its weights then come with the commit).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np

from daskdist.elastic.options import ElasticOptions
from daskdist.elastic.recovery import RECOVERABLE, Recovery
from daskdist.elastic.replica import take_commit
from daskdist.training.elastic import ElasticRunner

__all__ = ["ElasticFit"]

logger = logging.getLogger(__name__)

_FITS = itertools.count(1)


class ElasticFit(ElasticRunner):
    """One elastic ``fit`` of a built-in model.

    Parameters
    ----------
    runner
        The model's epoch runner (``keras.runner.ReplicaModelRunner``: its model, data, tag, and the recoveries while
        the model was installed).
    options
        The strategy's ``ElasticOptions``.
    """

    def __init__(self, runner: Any, options: ElasticOptions):
        self.runner = runner
        self.model: Any = runner.model
        strategy = self.model.distribute_strategy
        if strategy is None or strategy.extended.elastic is None:
            raise ValueError(f"model {self.model.name!r} was not created in the scope of an elastic strategy")
        # the losses while the model was installed are events of this fit and count against max_failures
        recoveries: list[Recovery] = runner.recoveries
        super().__init__(strategy, options, runner.train, recoveries, runner.failures)
        self.fit_id = next(_FITS)
        self.model_id = self.model.model_id
        self.train = runner.train
        self._input: tuple[tuple[int, ...] | None, str | None] | None = None  # the shape and dtype of ``x``
        logger.info("Elastic fit %d: epochs read %s", self.fit_id, self.input.describe_order())

    def replanned(self) -> None:
        self.runner.replan_validation()

    def take_first_commit(self, epoch: int) -> None:
        """The commit every replica can go back to before the first step (the model built everywhere)."""
        while True:
            try:
                if self._input is None:
                    self._input = _input_shape(self.train.element_spec_with(self.extended.client))
                shape, dtype = self._input
                key = (self.fit_id, epoch, 0)
                self.call_members(take_commit, (self.model.model_id, key, shape, dtype))
                return
            except RECOVERABLE as error:
                self.recover(error)

    def install_newcomer(self, rank: int) -> None:
        """Give a newcomer the model and every other model of the strategy the members hold (a commit restores
        them all: their weights and optimizer states then come with it)."""
        from daskdist.group.service import MODEL
        from daskdist.strategy.extended.replica_commands import install_resident

        for model in self.model.installed_beside():
            self.extended.run_on_replica(rank, install_resident, (MODEL, model.model_id, model.resident()))


def _input_shape(element_spec: Any) -> tuple[tuple[int, ...] | None, str | None]:
    """The shape (without the batch) and dtype of the model input ``x`` of an element spec."""
    import optree

    x = element_spec
    if isinstance(x, (tuple, list)):
        x = x[0]
    elif isinstance(x, dict) and "x" in x:
        x = x["x"]
    leaves = optree.tree_leaves(x, is_leaf=lambda s: hasattr(s, "shape") and hasattr(s, "dtype"))
    if len(leaves) != 1:
        return None, None
    spec = leaves[0]
    return tuple(int(d) for d in spec.shape[1:]), str(np.dtype(spec.dtype))
