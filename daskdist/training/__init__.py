"""The trainer: what every model kind's training shares, written once and knowing no framework.

An adapter (``daskdist.keras`` for the built-in layers, ``daskdist.plugins.keras3``
for Keras 3) supplies what differs: the replica's ``Trainable``, how a model is
installed on the replicas and its state taken back, callbacks and logs, and the
mapping from the framework's optimizer to an update rule (``update_rules``). This
package imports neither ``daskdist.keras`` nor ``daskdist.plugins`` (an
import contract in ``pyproject.toml`` keeps it so).

Modules
-------
update_rules
    The parameter stores' framework-free update rules (SGD, Adam, RMSprop).
replica
    ``ReplicaModel``: what an adapter's resident gives the trainer.
loop
    ``ReplicaLoop``: the one replica step loop over a shard (begin, steps, end).
commands
    The replica commands: a whole epoch, a loop in several commands, an evaluation, the model's state.
runners
    ``ReplicaRunner``: the client's side of an epoch or evaluation on the replicas, per-batch callbacks
    between ``steps_per_execution`` commands when asked.
elastic, commits
    Elastic epochs: ``ElasticRunner`` (client) and ``elastic_train_epoch`` (replica); commits copied off
    the step's path and replayed.
ps
    Parameter-server fit, evaluation and ``predict`` in coordinator closures: ``ClosureRunner`` (client),
    ``PsWorker`` (the workers' resident, the adapter's hooks), exactly-once evaluation shards, a lost
    parameter server raised as ``ParameterServerLostError``.
fit
    ``run_epochs``: the client's epoch loop every adapter's ``fit`` runs; ``EpochRunner``: an epoch or a
    validation on the replicas over the runner chosen (``ReplicaRunner``, the fit's ``ElasticRunner``).
runner_choice
    ``choose_runner``: which runner (local, replicas, stepwise, elastic, closures) a fit or an evaluation
    runs on, from the Extended's capabilities and the callbacks' per-batch hooks; every adapter asks it.
timer, progress
    The replica's step timer that reports each step; replica 0's live progress events.
"""
