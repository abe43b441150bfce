"""Errors raised by daskdist.

::

    DaskdistError
    ├── StrategyClosedError              (RuntimeError) the strategy was closed or its group failed
    │   └── ClientClosedError            the Dask client it was given (or uses) is closed
    ├── RendezvousError                  (TimeoutError) replicas did not all start in time
    ├── ReplicaLostError                 a member's worker left the cluster
    │   ├── ParameterServerLostError     a parameter server was lost: fatal for its strategy
    │   └── ElasticRecoveryError         elastic recovery cannot go on: ends the elastic run
    ├── StaleGenerationError             a message of an older membership generation was rejected
    ├── OutOfRangeError                  (StopIteration) get_next after the end of the data
    ├── CheckpointError                  (ValueError) a checkpoint is missing, damaged or does not fit
    ├── CollectiveError                  a collective could not complete
    │   ├── CollectiveMismatchError      (ValueError) replicas passed different shapes, dtypes or structures
    │   ├── CollectiveTimeoutError       (TimeoutError) a replica did not join within the deadline
    │   └── CollectiveAbortedError       another replica failed during the same run
    ├── OutsideScopeError                (ValueError) a Keras 3 model made outside a scope is trained inside it
    ├── UnsupportedBackendError          (ValueError) Keras 3 runs on a backend daskdist cannot train with
    ├── UnsupportedOptimizerError        (NotImplementedError) an optimizer the parameter stores cannot run
    ├── WeightsDifferError               (ValueError) the replicas' copies of a Keras 3 model differ
    ├── ScriptFailed                     a rank of ``python -m daskdist.torchrun`` exited non-zero or raised
    └── internal signals, caught inside daskdist (never raised to users):
        ├── MailboxTimeout               a tagged message did not arrive before its deadline
        ├── PayloadMismatch              a received array does not have the size the receiver expected
        ├── LaneMismatch                 a peer's message of the same collective has another signature
        └── StopAtCommit                 an elastic epoch's command ends at a commit (workers join or leave)

A builtin in parentheses is a second base: code that catches it (``except
ValueError``, a ``for`` loop ending on ``StopIteration``) keeps working.
The Keras 3 adapter's errors are also importable from ``daskdist.plugins.keras3``,
and each internal signal from the module that raises it.

The wire (``daskdist.wire``) sits below everything and imports nothing of
daskdist, so its two errors are ``ConnectionError`` subclasses defined there:
``PeerClosed`` (the peer closed the connection) and ``WireRejected`` (a
greeting of another protocol or with a wrong secret).

``ReplicaLostError`` is the recoverable error: an elastic strategy
(``elastic=dd.ElasticOptions(...)``) recovers from it by itself, on the
surviving workers; without elastic, a training loop that wants to survive a
lost worker catches exactly that, builds a new strategy on the remaining
workers and restores from its last checkpoint. Its two subclasses are the
losses nothing recovers from in place: ``ParameterServerLostError`` (the
variables lived on the lost ps; restart from a checkpoint) and
``ElasticRecoveryError`` (an elastic run that cannot re-form: too few
workers, no common commit, the recovery budget spent).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "ClientClosedError",
    "CollectiveAbortedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DaskdistError",
    "ElasticRecoveryError",
    "LaneMismatch",
    "MailboxTimeout",
    "OutOfRangeError",
    "OutsideScopeError",
    "ParameterServerLostError",
    "PayloadMismatch",
    "RendezvousError",
    "ReplicaLostError",
    "ScriptFailed",
    "StaleGenerationError",
    "StopAtCommit",
    "StrategyClosedError",
    "UnsupportedBackendError",
    "UnsupportedOptimizerError",
    "WeightsDifferError",
]


class DaskdistError(Exception):
    """Base class of every error daskdist raises itself."""


class StrategyClosedError(DaskdistError, RuntimeError):
    """The strategy was closed, or its replica group failed and cannot run more work."""


class ClientClosedError(StrategyClosedError):
    """The ``distributed.Client`` a strategy was given, or the one it runs on, is closed.

    Raised by a strategy's constructor for a closed client, and by ``run`` (and every command) once the
    client was closed under a live strategy: the scheduler then closes the strategy's replicas, so the
    strategy cannot run more work. Create a new client and a new strategy.
    """


class RendezvousError(DaskdistError, TimeoutError):
    """The replicas of a group did not all start and meet within the rendezvous timeout."""


class ReplicaLostError(DaskdistError):
    """A replica's worker left the cluster (crashed, was killed or was retired).

    Parameters
    ----------
    message
        What happened, naming the worker.
    worker
        The address of the lost worker, when known.
    """

    def __init__(self, message: str, worker: str | None = None):
        super().__init__(message)
        self.worker = worker

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.worker))


class ParameterServerLostError(ReplicaLostError):
    """A parameter server left the cluster: training cannot go on (TF's ``PSUnavailableError``; fatal).

    Raised by every later call of the strategy's ``ClusterCoordinator``
    (``schedule``, ``join``, ``done``, ``fetch``) within about a second of the
    loss, which the scheduler plugin announces like any lost group member.
    """


class ElasticRecoveryError(ReplicaLostError):
    """An elastic run cannot recover: too few workers, no common commit, or the recovery budget is spent.

    Ends the elastic run (never recovered from again); still a
    ``ReplicaLostError`` for code that catches losses.
    """


class OutOfRangeError(DaskdistError, StopIteration):
    """``get_next`` was called after the end of the data (TF's ``tf.errors.OutOfRangeError``)."""


class CheckpointError(DaskdistError, ValueError):
    """A checkpoint is missing, damaged, or does not fit the model."""


class StaleGenerationError(DaskdistError):
    """A message made for an earlier membership generation of a group was rejected (never consumed).

    Parameters
    ----------
    message
        What was rejected, with both generations.
    group_id, received, current
        The group, the generation the message carried, and the group's.
    """

    def __init__(self, message: str, group_id: str | None = None, received: int | None = None,
                 current: int | None = None):
        super().__init__(message)
        self.group_id = group_id
        self.received = received
        self.current = current

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.group_id, self.received, self.current))


class CollectiveError(DaskdistError):
    """A collective operation could not complete on this replica."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Replicas passed values of different structure, shape or dtype to one collective."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete before its deadline; names the replicas that never joined."""


class CollectiveAbortedError(CollectiveError):
    """The collective was aborted because another replica of the same run failed."""


# -- the Keras 3 adapter's errors -------------------------------------------------------


class OutsideScopeError(DaskdistError, ValueError):
    """A Keras object created outside a strategy's scope is compiled or trained inside it (TF refuses it too)."""


class UnsupportedBackendError(DaskdistError, ValueError):
    """Keras runs on a backend daskdist cannot train with (TensorFlow's is bound to TF's own strategies)."""


class UnsupportedOptimizerError(DaskdistError, NotImplementedError):
    """A Keras optimizer (or option) that the parameter stores cannot run."""


class WeightsDifferError(DaskdistError, ValueError):
    """The replicas' copies of a model do not hold the same weights at the start of training."""


# -- internal signals: raised and caught inside daskdist ----------------------------------


class MailboxTimeout(DaskdistError):
    """Internal: the deadline passed before the tagged message arrived."""


class PayloadMismatch(DaskdistError):
    """Internal: a received array does not have the size the receiver expected."""

    def __init__(self, got: object, expected: object):
        super().__init__(f"got {got} elements, expected {expected}")
        self.got = got
        self.expected = expected


class LaneMismatch(DaskdistError):
    """A peer's message of the same collective has another signature; ``peer_signature`` says what it passed."""

    def __init__(self, peer_signature: str):
        super().__init__(peer_signature)
        self.peer_signature = peer_signature


class StopAtCommit(DaskdistError):
    """Raised at a commit to end an epoch's command there: free workers wait to be admitted, or members retire."""

    def __init__(self, step: int, leave: bool):
        super().__init__(step)
        self.step = step
        self.leave = leave


class ScriptFailed(DaskdistError):
    """A rank of ``python -m daskdist.torchrun`` exited non-zero or raised: its rank, exit code and traceback
    (or its last output lines)."""

    def __init__(self, rank: int, code: int, report: str):
        super().__init__(rank, code, report)
        self.rank, self.code, self.report = rank, code, report

    def __str__(self) -> str:
        return f"rank {self.rank} exited with code {self.code}:\n{self.report}"


#: Error kinds carried in abort messages, mapped to the class each replica raises.
ERROR_KINDS: dict[str, type[DaskdistError]] = {
    "lost": ReplicaLostError,
    "stale": StaleGenerationError,
    "mismatch": CollectiveMismatchError,
    "timeout": CollectiveTimeoutError,
    "aborted": CollectiveAbortedError,
}


def kind_of(error: BaseException) -> str:
    """Return the abort-message kind for ``error`` (``"aborted"`` for user errors)."""
    for kind, cls in ERROR_KINDS.items():
        if isinstance(error, cls):
            return kind
    return "aborted"
