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
timer
    The replica's step timer whose finished steps reach the scheduler.
progress
    Replica 0's live progress events (the dashboard's ``fit`` progress).
loop
    One replica step loop over a shard: begin, steps, end.
stepwise
    The client's side of a loop run in several commands (per-batch callbacks between).
"""
