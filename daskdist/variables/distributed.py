"""Variables: ordinary, mirrored (one synchronized copy per replica) and sync-on-read.

``dd.Variable(...)`` builds what the context asks for, as ``tf.Variable`` does:
outside any strategy an ordinary ``Variable``; inside ``strategy.scope()`` on
the client a ``MirroredVariable`` (or ``SyncOnReadVariable`` for
``synchronization=ON_READ``) whose copies live on the replicas; inside a
replica function a variable created collectively, replica 0's initial value
broadcast to all.

A distributed variable pickles as a reference (group token + id), so a
function that captures it ships a few bytes, and on each replica the
reference resolves to that replica's own copy.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from daskdist import context, registry
from daskdist.arrays import as_array, namespace, to_numpy
from daskdist.dtype_inference import is_python_value, python_value_array
from daskdist.exceptions import StrategyClosedError
from daskdist.group.service import VARIABLE
from daskdist.ops import ReduceOp

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = [
    "MirroredVariable",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSpec",
    "VariableSynchronization",
]


class VariableAggregation(enum.Enum):
    """How replica updates to a distributed variable are combined (TF's ``VariableAggregation``)."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


class VariableSynchronization(enum.Enum):
    """When a distributed variable is synchronized (TF's ``VariableSynchronization``)."""

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"


_AGGREGATION_OPS = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}


@dataclass(frozen=True)
class VariableSpec:
    """What a variable is, without its value."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    trainable: bool
    aggregation: VariableAggregation
    synchronization: VariableSynchronization

    @classmethod
    def build(
        cls,
        initial_value: Any,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        aggregation: VariableAggregation | str = VariableAggregation.NONE,
        synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
        shape: Any = None,
    ) -> tuple[Any, VariableSpec]:
        """Validate ``tf.Variable``'s arguments; return the initial array and the spec."""
        if initial_value is None:
            raise ValueError("initial_value must be given")
        if callable(initial_value):
            initial_value = initial_value()
        value = python_value_array(initial_value) if is_python_value(initial_value) else as_array(initial_value)[0]
        xp = namespace(value)
        if dtype is not None:
            value = value.astype(np.dtype(dtype), copy=False)
        value = xp.array(value, copy=True)
        aggregation = _enum(VariableAggregation, aggregation, "aggregation", name)
        synchronization = _enum(VariableSynchronization, synchronization, "synchronization", name)
        if trainable is None:  # TF 2: ON_READ variables default to non-trainable; an explicit True is kept
            trainable = synchronization is not VariableSynchronization.ON_READ
        if shape is not None and tuple(shape) != tuple(value.shape):
            raise ValueError(f"shape {tuple(shape)} does not match the initial value's shape {tuple(value.shape)}")
        spec = cls(
            name=name or "Variable",
            dtype=value.dtype.str,
            shape=tuple(int(d) for d in value.shape),
            trainable=bool(trainable),
            aggregation=aggregation,
            synchronization=synchronization,
        )
        return value, spec


_E = TypeVar("_E", bound=enum.Enum)


def _enum(enum_cls: type[_E], value: Any, what: str, variable_name: str | None) -> _E:
    if value is None and enum_cls is VariableAggregation:
        return enum_cls["NONE"]  # TF accepts aggregation=None
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls[str(value).upper()]
    except KeyError:
        names = ", ".join(m.name for m in enum_cls)
        raise ValueError(
            f"Invalid variable {what} mode: {value} for variable: {variable_name or 'Variable'} "
            f"(expected one of {names})"
        ) from None


class _ArrayOps:
    """Arithmetic on a variable reads its value, like a tensor."""

    def value(self) -> Any:
        raise NotImplementedError

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = to_numpy(self.value())
        return array.astype(dtype) if dtype is not None else np.array(array, copy=True)

    def __add__(self, o: Any) -> Any: return self.value() + _v(o)
    def __radd__(self, o: Any) -> Any: return _v(o) + self.value()
    def __sub__(self, o: Any) -> Any: return self.value() - _v(o)
    def __rsub__(self, o: Any) -> Any: return _v(o) - self.value()
    def __mul__(self, o: Any) -> Any: return self.value() * _v(o)
    def __rmul__(self, o: Any) -> Any: return _v(o) * self.value()
    def __truediv__(self, o: Any) -> Any: return self.value() / _v(o)
    def __rtruediv__(self, o: Any) -> Any: return _v(o) / self.value()
    def __matmul__(self, o: Any) -> Any: return self.value() @ _v(o)
    def __rmatmul__(self, o: Any) -> Any: return _v(o) @ self.value()
    def __pow__(self, o: Any) -> Any: return self.value() ** _v(o)
    def __neg__(self) -> Any: return -self.value()
    def __getitem__(self, index: Any) -> Any: return self.value()[index]
    def __len__(self) -> int: return len(self.value())


def _v(x: Any) -> Any:
    return x.value() if isinstance(x, _ArrayOps) else x


class _VariableMeta(type):
    """``Variable(...)`` asks the current context's variable creator first (TF's metaclass trick)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable:
            frame = context.current_frame()
            if frame is not None and frame.variable_creator is not None:
                return frame.variable_creator(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Variable(_ArrayOps, metaclass=_VariableMeta):
    """A variable (TF's ``tf.Variable`` arguments).

    Created outside any strategy this is an ordinary variable holding one
    array. A function passed to ``strategy.run`` that captures it receives a
    copy on each replica; create it inside ``strategy.scope()`` to get a
    ``MirroredVariable`` that replicas update together.
    """

    def __init__(
        self,
        initial_value: Any = None,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        aggregation: VariableAggregation | str = VariableAggregation.NONE,
        synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
        shape: Any = None,
    ):
        self._value, self._spec = VariableSpec.build(
            initial_value, trainable, name, dtype, aggregation, synchronization, shape
        )

    # -- description ------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._spec.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def trainable(self) -> bool:
        return self._spec.trainable

    @property
    def aggregation(self) -> VariableAggregation:
        return self._spec.aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._spec.synchronization

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self.name}' shape={self.shape} dtype={self.dtype.name}, numpy={self.numpy()!r}>"

    # -- reading and writing -------------------------------------------------------

    def value(self) -> Any:
        """The current value (not a copy; do not modify it in place)."""
        return self._value

    def read_value(self) -> Any:
        """A copy of the current value."""
        return namespace(self._value).array(self._value, copy=True)

    def numpy(self) -> np.ndarray:
        """The current value as a numpy array on the host."""
        return np.array(to_numpy(self.value()), copy=True)

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Set the value (TF's arguments).

        ``use_locking`` and ``name`` are accepted for TensorFlow compatibility
        (an update is always applied whole; there is no graph to name ops in).
        Returns the variable, or ``None`` with ``read_value=False``.
        """
        self._write(self._convert(value))
        return self if read_value else None

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> Any:
        """Add ``delta`` to the value (arguments as ``assign``)."""
        self._write(self.value() + self._convert(delta))
        return self if read_value else None

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> Any:
        """Subtract ``delta`` from the value (arguments as ``assign``)."""
        self._write(self.value() - self._convert(delta))
        return self if read_value else None

    def _convert(self, value: Any) -> Any:
        array, _ = as_array(value)
        if tuple(array.shape) != self.shape and array.ndim != 0:
            raise ValueError(
                f"Cannot assign a value of shape {tuple(array.shape)} to variable '{self.name}' of shape {self.shape}"
            )
        return array.astype(self.dtype, copy=False)

    def _write(self, new_value: Any) -> None:
        xp = namespace(self._value)
        xp.copyto(self._value, new_value, casting="unsafe")


class DistributedVariable(Variable):
    """A variable with one copy per replica of a strategy (base of Mirrored / SyncOnRead).

    On the client it is a handle: reads and writes are commands to the
    replicas. Inside a replica it is that replica's copy.
    """

    def __init__(self, spec: VariableSpec, token: str, var_id: str, owner: Any = None, local_value: Any = None,
                 runtime: ReplicaService | None = None):
        self._spec = spec
        self._token = token
        self._var_id = var_id
        self._owner = owner  # client: the strategy's extended object
        self._runtime = runtime  # replica: the replica runtime
        self._value = local_value

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        target = context.shipping_target()
        if target is not None and target.extended.token != self._token:  # a Strategy (only its run ships)
            owner = self._owner or registry.lookup(self._token)
            mine = context.describe_strategy(owner.strategy) if owner is not None else f"strategy {self._token}"
            raise ValueError(
                f"Variable '{self.name}' belongs to {mine} and cannot be used in a function run by "
                f"{context.describe_strategy(target)}: mixing different tf.distribute.Strategy objects; create it "
                "in that strategy's scope"
            )
        return (_resolve_variable, (self._token, self._var_id, self._spec))

    @property
    def var_id(self) -> str:
        """The id the strategy keeps this variable under (on its replicas, or in its parameter store)."""
        return self._var_id

    @property
    def spec(self) -> VariableSpec:
        """How the variable was made: name, shape, dtype, trainable, synchronization, aggregation."""
        return self._spec

    @property
    def distribute_strategy(self) -> Any:
        """The strategy this variable belongs to (inside a replica, that replica's view of it)."""
        if self._on_replica():
            return self._service.strategy_view
        return self._client_owner().strategy

    # -- where are we? -------------------------------------------------------------

    def _on_replica(self) -> bool:
        return self._runtime is not None

    @property
    def _service(self) -> ReplicaService:
        """The replica a replica's copy lives on (only asked on replicas)."""
        if self._runtime is None:
            raise RuntimeError(f"variable {self._var_id} is the client's handle, not a replica's copy")
        return self._runtime

    # -- resident state (replica copies: ``daskdist.group.service.Resident``) ---------------

    def snapshot(self) -> Any:
        """A copy of this replica's value, for ``ResidentStore.snapshot``."""
        if not self._on_replica():
            raise RuntimeError(f"Variable '{self.name}': snapshot() is for a replica's copy, not the client's handle")
        return namespace(self._value).array(self._value, copy=True)

    def restore(self, state: Any) -> None:
        """Write a value from ``snapshot`` into this replica's copy (in place, bit for bit)."""
        if not self._on_replica():
            raise RuntimeError(f"Variable '{self.name}': restore() is for a replica's copy, not the client's handle")
        Variable._write(self, state)

    def _client_owner(self) -> Any:
        owner = self._owner or registry.lookup(self._token)
        if owner is None:
            raise StrategyClosedError(
                f"Variable '{self.name}' belongs to a strategy that is closed or lives in another process"
            )
        return owner

    def local_results(self) -> tuple[Any, ...]:
        """Every replica's copy (TF's ``_local_results``; one element for a variable held in a store)."""
        return tuple(self._client_owner().read_variable(self._var_id, all_replicas=True))

    # -- reading ----------------------------------------------------------------

    def value(self) -> Any:
        if self._on_replica():
            return self._value
        return self._client_owner().read_variable(self._var_id)

    def read_value(self) -> Any:
        value = self.value()
        return namespace(value).array(value, copy=True) if self._on_replica() else value

    # -- writing ----------------------------------------------------------------

    def _update(self, method: str, value: Any) -> None:
        self._check_update(method)
        if not self._on_replica():
            self._client_owner().update_variable(self._var_id, method, value)
            return
        array = self._convert(value)
        if self._needs_aggregation():
            array = self._aggregate(array)
        start = time.perf_counter()
        if method == "assign":
            new_value = array
        elif method == "assign_add":
            new_value = self._value + array
        else:
            new_value = self._value - array
        Variable._write(self, new_value)
        self._service.timer.add_apply(time.perf_counter() - start)

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        self._update("assign", value)
        return self if read_value else None

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> Any:
        self._update("assign_add", delta)
        return self if read_value else None

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> Any:
        self._update("assign_sub", delta)
        return self if read_value else None

    def _in_cross_replica_context(self) -> bool:
        """The client, or a cross-replica frame (``merge_call``, ``extended.update``) on a replica."""
        if not self._on_replica():
            return True
        frame = context.current_frame()
        return frame is not None and frame.replica_context is None

    def _check_update(self, method: str) -> None:
        """Raise where TensorFlow refuses an update (before anything is sent or changed)."""

    def _needs_aggregation(self) -> bool:
        return False

    def _aggregate(self, array: Any) -> Any:
        return array


class MirroredVariable(DistributedVariable):
    """Copies kept identical on every replica (``synchronization`` ON_WRITE or AUTO).

    An update in replica context is first aggregated across replicas per
    ``aggregation`` (SUM, MEAN, ONLY_FIRST_REPLICA) and then applied to every
    copy, so all replicas must make it together. With ``aggregation=NONE``
    it raises ``ValueError``, the rule ``tf.VariableAggregation`` documents
    (TensorFlow 2.21's code instead updates each replica's copy, which lets
    the copies drift apart). A MEAN variable must have a float dtype
    (refused at creation, as in TensorFlow). An update from the client (or
    inside ``merge_call`` / ``extended.update``) applies the same value to
    every copy.
    """

    def _needs_aggregation(self) -> bool:
        frame = context.current_frame()
        return frame is not None and frame.replica_context is not None

    def _aggregate(self, array: Any) -> Any:
        frame = context.current_frame()
        ctx = frame.replica_context if frame is not None else None
        if ctx is None:  # ``_needs_aggregation`` said this runs in replica context
            raise RuntimeError(f"variable '{self.name}' aggregates an update in replica context only")
        aggregation = self.aggregation
        if ctx.num_replicas_in_sync == 1:
            return array
        if aggregation is VariableAggregation.NONE:
            raise ValueError(
                f"You must specify an aggregation method to update a MirroredVariable in Replica Context. You can "
                f"do so by passing an explicit value for argument `aggregation` to tf.Variable(..) (variable "
                f"'{self.name}': aggregation=SUM, MEAN or ONLY_FIRST_REPLICA), or update it in cross-replica "
                "context: from the client, inside merge_call or strategy.extended.update"
            )
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return ctx.broadcast(array, root=0)
        return ctx.all_reduce(_AGGREGATION_OPS[aggregation], array)


class SyncOnReadVariable(DistributedVariable):
    """Each replica updates its own copy; reading from the client aggregates them (``ON_READ``).

    Used for metrics and batch-norm statistics: replicas update locally with no
    communication; the client sees the SUM, MEAN or first replica's value.
    In cross-replica context ``assign`` of a SUM variable gives each copy
    ``value / num_replicas`` (so the read gives ``value``), and ``assign_add``
    / ``assign_sub`` of a SUM variable raise ``ValueError``, as in TensorFlow.
    """

    def _check_update(self, method: str) -> None:
        if (
            method != "assign"
            and self.aggregation is VariableAggregation.SUM
            and self._in_cross_replica_context()
        ):
            raise ValueError(
                f"SyncOnReadVariable does not support `{method}` in cross-replica context when aggregation "
                "is set to `tf.VariableAggregation.SUM`."
            )

    def value(self) -> Any:
        if self._on_replica():
            return self._value
        values = self.local_results()
        aggregation = self.aggregation
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return values[0]
        if aggregation is VariableAggregation.NONE:
            raise ValueError(
                f"Cannot read SyncOnReadVariable '{self.name}' in cross-replica context with aggregation NONE"
            )
        from daskdist.values import PerReplica, reduce_values

        return reduce_values(_AGGREGATION_OPS[aggregation], PerReplica(values), None, len(values))


def _is_floating(dtype: np.dtype) -> bool:
    """Float or complex; ``ml_dtypes`` floats (bfloat16, float8) count, which a spec's ``dtype.str`` shows as kind ``V``."""
    return dtype.kind in "fcV" or dtype.name == "bfloat16"


def check_same_spec_on_every_replica(specs: list[VariableSpec]) -> None:
    """A variable created in a replica function must be the same variable on every replica.

    ``specs`` holds every replica's spec in replica order (all replicas see
    the same list, so all raise or none does). Raises ``RuntimeError`` as
    TensorFlow does ("Tried to create variable ... with mismatching name on
    device i"), naming the first field that differs.
    """
    first = specs[0]
    for device, spec in enumerate(specs[1:], start=1):
        if spec == first:
            continue
        if spec.name != first.name:
            raise RuntimeError(f"Tried to create variable {spec.name} with mismatching name on device {device}")
        field = next(f for f in ("dtype", "shape", "trainable", "aggregation", "synchronization")
                     if getattr(spec, f) != getattr(first, f))
        raise RuntimeError(
            f"Tried to create variable {spec.name} with mismatching {field} on device {device}: "
            f"{getattr(spec, field)} where replica 0 has {getattr(first, field)}"
        )


def _resolve_variable(token: str, var_id: str, spec: VariableSpec) -> DistributedVariable:
    """Unpickle a variable reference: the replica's own copy, or the client's handle."""
    runtime = context.current_runtime()
    if runtime is not None and runtime.token == token:
        found: DistributedVariable = runtime.objects.get(VARIABLE, var_id)
        return found
    owner = registry.lookup(token)
    if owner is not None:
        handle: DistributedVariable = owner.variable_handle(var_id, spec)
        return handle
    cls = SyncOnReadVariable if spec.synchronization is VariableSynchronization.ON_READ else MirroredVariable
    return cls(spec, token, var_id)


def distributed_variable_class(spec: VariableSpec) -> type[DistributedVariable]:
    """``SyncOnReadVariable`` for ON_READ, ``MirroredVariable`` otherwise.

    Raises ``ValueError`` where TensorFlow refuses to create a distributed
    variable: ``synchronization=NONE``, and MEAN aggregation of a non-float
    dtype (a mean of integers would lose precision).
    """
    if spec.synchronization is VariableSynchronization.NONE:
        raise ValueError(
            "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please change "
            f"the `synchronization` for variable: {spec.name}"
        )
    if spec.aggregation is VariableAggregation.MEAN and not _is_floating(np.dtype(spec.dtype)):
        raise ValueError(
            "creating distributed tf.Variable with aggregation=MEAN and a non-floating dtype is not "
            f"supported, please use a different aggregation or dtype (variable '{spec.name}', dtype "
            f"{np.dtype(spec.dtype).name})"
        )
    if spec.synchronization is VariableSynchronization.ON_READ:
        return SyncOnReadVariable
    return MirroredVariable
