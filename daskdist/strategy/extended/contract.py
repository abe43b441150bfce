"""``StrategyExtended``: the contract every strategy implements (TF's ``tf.distribute.StrategyExtended``).

A strategy is a thin facade over an Extended. The Extended owns the verbs
that decide *where* things run and live; ``keras/`` and ``data/`` speak only
these verbs, so they never learn which strategy they run under:

TensorFlow's verbs
    ``call_for_each_replica``, ``create_variable`` (placement decided by the
    subclass in ``_variable_placement``), ``reduce_to``, ``batch_reduce_to``,
    ``update``, ``read_var``, ``variable_created_in_scope``,
    ``colocate_vars_with``, ``distribute_dataset``,
    ``distribute_datasets_from_function``.
Verbs keras and data need beyond TensorFlow's
    ``run_on_replicas`` (a command on every replica that computes),
    ``run_on_replica`` (a command on one of them, e.g. to read weights),
    ``install_resident`` (a model or other object kept on every replica),
    ``provide_residents`` (what a framework adapter installs before a replica
    function is shipped: the residents it may capture).

The public methods do TensorFlow's checks (cross-replica context, argument
types) and then call an implementation hook, as TF's ``reduce_to`` calls
``_reduce_to``. The semantics on the client follow TF's ``MirroredExtended``
(``mirrored_strategy.py``); the SPMD implementation is in
``daskdist.strategy.extended.spmd``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import optree

from daskdist import context
from daskdist.cross_device_ops import validate_destinations
from daskdist.ops import CommunicationOptions, ReduceOp
from daskdist.values import DistributedValues, Mirrored, PerReplica, check_num_components, local_results
from daskdist.variables.distributed import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
)

if TYPE_CHECKING:
    from distributed import Client

    from daskdist.cross_device_ops import CrossDeviceOps
    from daskdist.data.distributed import DistributedDataset
    from daskdist.strategy.drivers.contract import StepDriver
    from daskdist.strategy.extended.elastic_options import ElasticOptions
    from daskdist.variables.distributed import VariableSpec

__all__ = ["Args", "Command", "Kwargs", "StrategyExtended"]

#: Positional and keyword arguments of a function or command.
Args = tuple[Any, ...]
Kwargs = dict[str, Any]

#: A command sent to replicas: ``command(service, *args)`` where ``service`` is the replica's
#: ``daskdist.group.service.ReplicaService``.
Command = Callable[..., Any]


class StrategyExtended(abc.ABC):
    """What a strategy does, independently of how its replicas are reached (TF's ``StrategyExtended``).

    Subclasses implement the hooks (``_call_for_each_replica``,
    ``_variable_placement``, ``_run_on``, ...); the public verbs here carry
    TensorFlow's argument checks and semantics.
    """

    strategy: Any
    """The public ``Strategy`` facade this implements (TF's ``_container_strategy()``)."""

    # -- what subclasses describe ---------------------------------------------------

    @property
    @abc.abstractmethod
    def token(self) -> str:
        """The strategy's identity: what variable handles and distributed datasets pickle."""

    @property
    @abc.abstractmethod
    def num_replicas(self) -> int:
        """Replicas that run each step in sync (TF's ``_num_replicas_in_sync``)."""

    @property
    @abc.abstractmethod
    def worker_devices(self) -> tuple[str, ...]:
        """The device of each compute replica, in replica order (TF's ``worker_devices``)."""

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices variables are placed on (TF's ``parameter_devices``)."""
        return tuple(self.worker_devices[r] for r in self._variable_placement(None))

    @property
    @abc.abstractmethod
    def worker_addresses(self) -> tuple[str, ...]:
        """The Dask worker of each compute replica, in replica order."""

    @property
    @abc.abstractmethod
    def client(self) -> Client:
        """The ``distributed.Client`` the replicas are driven through."""

    @property
    def cross_device_ops(self) -> CrossDeviceOps | None:
        return None

    # -- what the trainers ask of a strategy (capabilities, not attributes probed for) --------

    @property
    def elastic(self) -> ElasticOptions | None:
        """``ElasticOptions`` when the strategy is elastic (its group re-forms after a loss), else ``None``."""
        return None

    @property
    def schedules_closures(self) -> bool:
        """Whether ``fit``/``evaluate`` run as coordinator closures (parameter servers) rather than replica commands."""
        return False

    # One client drives every replica, so it is the single place that initialises, checkpoints and
    # writes summaries (TF's between-graph strategies answer these per worker process).

    @property
    def experimental_between_graph(self) -> bool:
        """Whether each worker runs its own copy of the program (never: one client drives all)."""
        return False

    @property
    def experimental_should_init(self) -> bool:
        """Whether this program initialises variables (always: it is the only program)."""
        return True

    @property
    def should_checkpoint(self) -> bool:
        """Whether checkpointing is needed here: the client is the single writer."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether summaries (TensorBoard) are written here: the client is the single writer."""
        return True

    @abc.abstractmethod
    def check_open(self) -> None:
        """Raise ``StrategyClosedError`` once the strategy is closed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the replicas and free what they hold (idempotent)."""

    # -- running ----------------------------------------------------------------------

    def call_for_each_replica(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                              kwargs: Kwargs | None = None) -> Any:
        """Run ``fn(*args, **kwargs)`` once per replica; distributed arguments give each replica its component.

        Returns the results regrouped as TF does (``PerReplica`` leaves; the
        value itself with one replica).
        """
        self.check_open()
        args, kwargs = tuple(args), dict(kwargs or {})
        check_num_components((args, kwargs), self.num_replicas)
        self.place_residents()
        return self._call_for_each_replica(fn, args, kwargs)

    @abc.abstractmethod
    def _call_for_each_replica(self, fn: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        ...

    @abc.abstractmethod
    def step_timings(self, last: int | None = None) -> list[list[Kwargs]]:
        """Per replica, the phase timings of the most recent steps."""

    # -- commands (the verbs keras and data use) -------------------------------------------

    def run_on_replicas(self, command: Command, args: Args = (), *,
                        args_per_replica: Sequence[Args] | None = None) -> list[Any]:
        """Run ``command(service, *args)`` on every compute replica; their results in replica order.

        Parameters
        ----------
        args
            The arguments every replica gets.
        args_per_replica
            Instead of ``args``: one argument tuple per replica, in replica order.
        """
        self.check_open()
        if args_per_replica is not None:
            args_per_replica = [tuple(a) for a in args_per_replica]
            if len(args_per_replica) != self.num_replicas:
                raise ValueError(
                    f"args_per_replica has {len(args_per_replica)} entries for {self.num_replicas} replicas"
                )
            return self._run_on(command, args_per_replica, None)
        return self._run_on(command, tuple(args), None)

    def run_on_replica(self, replica: int, command: Command, args: Args = ()) -> Any:
        """Run ``command(service, *args)`` on one compute replica (no collectives); its result."""
        self.check_open()
        if not 0 <= int(replica) < self.num_replicas:
            raise ValueError(f"replica {replica} is not one of the strategy's {self.num_replicas} replicas")
        return self._run_on(command, tuple(args), [int(replica)])[0]

    def install_resident(self, kind: str, object_id: str, obj: Any) -> None:
        """Keep ``obj`` on every compute replica, found there by ``(kind, object_id)``.

        ``kind`` is one of the resident kinds of ``daskdist.group.service``
        (``MODEL``, ``DATASET``, ...). An object installed again under the same
        key replaces the previous one. On the replica,
        ``service.objects.get(kind, object_id)`` returns it; an object with
        ``snapshot()``/``restore(state)`` takes part in resident snapshots.
        """
        from daskdist.strategy.extended import replica_commands

        self.run_on_replicas(replica_commands.install_resident, (kind, object_id, obj))

    _resident_providers: dict[str, Callable[[], None]] | None = None

    def provide_residents(self, key: str, provide: Callable[[], None]) -> None:
        """Call ``provide()`` before every function shipped to the replicas (``place_residents``).

        A framework adapter installs there (``install_resident``) what a replica
        function may capture, e.g. ``daskdist.plugins.keras3`` the built Keras
        models created in this strategy's scope, which the function's pickled
        references then find on each replica. One provider per ``key``: a second
        call with the same key replaces the first.
        """
        if self._resident_providers is None:
            self._resident_providers = {}
        self._resident_providers[key] = provide

    def place_residents(self) -> None:
        """Call every ``provide_residents`` provider: before a function that may capture residents is shipped
        (``call_for_each_replica``; ``ClusterCoordinator.schedule`` under ParameterServerStrategy)."""
        for provide in list((self._resident_providers or {}).values()):
            provide()

    @abc.abstractmethod
    def _run_on(self, command: Command, args: Args | list[Args], ranks: list[int] | None) -> list[Any]:
        """Send ``command`` to ``ranks`` (``None``: all); ``args`` shared or one tuple per replica."""

    @abc.abstractmethod
    def step_driver(self, key: str | None = None) -> StepDriver:
        """The step driver that trains a ``Trainable`` under this strategy (``training_contract``).

        ``key`` names the trainable's parameters where the strategy holds
        them off the replicas (parameter holder, parameter servers): reuse
        the key (or the driver) to go on training the same parameters;
        ``None``: a fresh one. The SPMD driver ignores it.
        """

    # -- variables ------------------------------------------------------------------------

    @abc.abstractmethod
    def create_variable(self, *args: Any, **kwargs: Any) -> DistributedVariable:
        """``dd.Variable(...)`` inside ``scope()``: a distributed variable placed by the strategy."""

    def _variable_placement(self, spec: VariableSpec | None) -> list[int]:
        """The replicas that hold a copy of a new variable (Mirrored: every replica).

        The hook a strategy with another placement overrides (one parameter
        holder for CentralStorage, ps members for ParameterServer).
        """
        return list(range(self.num_replicas))

    @abc.abstractmethod
    def variable_handle(self, var_id: str, spec: VariableSpec) -> DistributedVariable:
        """The client's handle for a variable (also for one created inside a replica function)."""

    @abc.abstractmethod
    def read_variable(self, var_id: str, all_replicas: bool = False) -> Any:
        """One holder's copy of a variable, or (``all_replicas``) every holder's copy as a list."""

    @abc.abstractmethod
    def update_variable(self, var_id: str, method: str, value: Any) -> None:
        """A cross-replica ``assign``/``assign_add``/``assign_sub`` from the client, applied to every copy."""

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` was created while this strategy's scope was active (TF's docstring example).

        Variables created in ``scope()`` (or inside a replica function of this
        strategy) are owned by it; ordinary variables and other strategies'
        are not.
        """
        if not isinstance(v, Variable):
            raise TypeError(f"variable_created_in_scope takes a variable, got {type(v).__name__}")
        return isinstance(v, DistributedVariable) and v._token == self.token

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside the block are placed where ``colocate_with_variable`` is (TF's API)."""
        self._validate_colocate_with_variable(colocate_with_variable)
        previous = self._colocation
        self._colocation = self._variable_holders(colocate_with_variable.var_id)
        try:
            yield
        finally:
            self._colocation = previous

    _colocation: list[int] | None = None

    def _validate_colocate_with_variable(self, variable: Any) -> None:
        # TF: distribute_utils.validate_colocate_distributed_variable
        if not isinstance(variable, DistributedVariable):
            raise ValueError(  # noqa: TRY004 - TF's error
                "`colocate_vars_with` must only be passed a variable created in this "
                f"tf.distribute.Strategy.scope(), not {variable!r}"
            )
        if variable._token != self.token:
            raise ValueError(
                "`colocate_vars_with` must only be passed a variable created in this "
                f"tf.distribute.Strategy.scope(), not: {variable!r}"
            )

    def _variable_holders(self, var_id: str) -> list[int]:
        """The replicas holding a copy of variable ``var_id``."""
        return list(range(self.num_replicas))

    def read_var(self, v: Any) -> Any:
        """The aggregate value of a sync-on-read variable, or the value of a mirrored one (TF's ``read_var``).

        ``MirroredExtended.read_var`` in TF: ``SyncOnReadVariable`` ->
        ``_get_cross_replica()``; a mirrored variable -> a copy of its value.
        """
        self._require_cross_replica("extended.read_var")
        self._check_own_variable(v, "read_var")
        if isinstance(v, SyncOnReadVariable):
            return v.value()  # aggregated across the replicas per its aggregation
        return v.read_value()

    def _check_own_variable(self, v: Any, api: str) -> None:
        if not isinstance(v, DistributedVariable):
            raise ValueError(  # noqa: TRY004 - TF asserts; ValueError as for its other misuses
                f"extended.{api} needs a variable created in this strategy's scope(), "
                f"got {type(v).__name__} {getattr(v, 'name', '')!r}"
            )
        if v._token != self.token:
            raise ValueError(f"extended.{api}: variable {v.name!r} belongs to another strategy")

    # -- reductions and updates in cross-replica context ------------------------------------

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """Combine ``value`` across replicas onto ``destinations`` (TF's ``reduce_to``).

        Parameters
        ----------
        reduce_op
            ``ReduceOp`` or its name (``"SUM"``, ``"MEAN"``, ...).
        value
            A ``PerReplica`` (results of ``run``), a distributed variable, a
            plain value, or a structure of them.
        destinations
            Where the result goes: a distributed variable or value (every one
            of its devices: the result is ``Mirrored``), a device string (one
            device: the plain value), or an array (the client: the plain
            value). The destination variable is not updated.

        Returns
        -------
        The reduced value: ``Mirrored`` when ``destinations`` spans several
        replicas, else the plain reduced value. As in TF, a ``Mirrored`` value
        reduced with MEAN is returned as is, and a non-distributed value with
        MEAN is that value; a non-distributed value cannot be SUM-reduced over
        several replicas (``ValueError``), and 0 reduces to 0.
        """
        self._require_cross_replica("extended.reduce_to")
        op = _check_reduce_op(reduce_op)
        if isinstance(destinations, (list, tuple)):
            raise ValueError(  # noqa: TRY004 - TF asserts; ValueError as validate_destinations
                "destinations must be one distributed value, variable, device string or array, "
                f"not a {type(destinations).__name__}"
            )
        self.check_open()
        return self._reduce_to(op, value, destinations, options or CommunicationOptions())

    def _reduce_to(self, op: ReduceOp, value: Any, destinations: Any, options: CommunicationOptions) -> Any:
        """TF's ``MirroredExtended._reduce_to`` on values the client holds."""
        if _is_mirrored(value) and op is ReduceOp.MEAN:
            return value
        if _is_mirrored(value):
            raise ValueError(
                f"a Mirrored value or mirrored variable cannot be reduced with {op.name}: its components are "
                "the same value on every replica (only MEAN, which returns it as is)"
            )
        from daskdist.values import reduce_values

        def reduce_leaf(leaf: Any) -> Any:
            if isinstance(leaf, SyncOnReadVariable):
                leaf = PerReplica(leaf.local_results())
            if not isinstance(leaf, DistributedValues):
                return self._reduce_non_distributed(op, leaf, destinations)
            validate_destinations(destinations)
            check_num_components(leaf, self.num_replicas)
            reduced = reduce_values(op, leaf, None, len(leaf))
            return self._to_destinations(reduced, destinations)

        return optree.tree_map(reduce_leaf, value, is_leaf=_is_value_leaf, none_is_leaf=True)

    def _reduce_non_distributed(self, op: ReduceOp, value: Any, destinations: Any) -> Any:
        # TF: cross_device_ops.reduce_non_distributed_value
        if _is_zero(value):
            return 0
        if op is ReduceOp.MEAN:
            return value
        if self.num_replicas != 1:
            raise ValueError(f"A non-DistributedValues value {value!r} cannot be reduced with the given "
                             f"reduce op {op}.")
        validate_destinations(destinations)
        return self._to_destinations(value, destinations)

    def _to_destinations(self, value: Any, destinations: Any) -> Any:
        """``value`` on every device of ``destinations``: ``Mirrored`` over several, the value on one."""
        count = _destination_count(destinations, self)
        return value if count == 1 else Mirrored([value] * count)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]],
                        options: CommunicationOptions | None = None) -> list[Any]:
        """Several ``reduce_to`` in one call (TF's ``batch_reduce_to``); one result per pair."""
        self._require_cross_replica("extended.batch_reduce_to")
        op = _check_reduce_op(reduce_op)
        if not isinstance(value_destination_pairs, (list, tuple)) or not all(
            isinstance(pair, tuple) and len(pair) == 2 for pair in value_destination_pairs
        ):
            raise ValueError("value_destination_pairs must be a list or a tuple of (value, destinations) tuples")
        options = options or CommunicationOptions()
        return [self.reduce_to(op, value, destinations, options) for value, destinations in value_destination_pairs]

    def update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Kwargs | None = None,
               group: bool = True) -> Any:
        """Run ``fn(copy, *args, **kwargs)`` on every copy of ``var`` (TF's ``extended.update``).

        ``fn`` runs where each copy lives, in cross-replica context (its
        ``assign`` calls apply to that copy as given, without aggregation).
        Distributed values among ``args``/``kwargs`` are unwrapped to each
        copy's component; distributed variables resolve to the local copy.

        Returns
        -------
        ``group=True``: the results regrouped with ``Mirrored`` leaves (a
        distributed variable returned by ``fn`` comes back as that variable;
        with one copy the result itself). ``group=False``: a structure whose
        leaves are tuples with one element per copy.
        """
        self._require_cross_replica("extended.update")
        if not callable(fn):
            raise TypeError(f"extended.update needs a callable fn, got {type(fn).__name__}")
        self._check_own_variable(var, "update")
        self.check_open()
        args, kwargs = tuple(args), dict(kwargs or {})
        holders = self._variable_holders(var.var_id)
        check_num_components((args, kwargs), len(holders))
        results = self._update(var, fn, args, kwargs, holders)
        from daskdist.values import regroup

        regrouped = regroup(results)
        if len(results) > 1:
            regrouped = optree.tree_map(
                lambda x: Mirrored(x.values) if isinstance(x, PerReplica) else x, regrouped,
                is_leaf=_is_value_leaf, none_is_leaf=True,
            )
        if group:
            return regrouped
        return optree.tree_map(local_results, regrouped, is_leaf=_is_value_leaf, none_is_leaf=True)

    @abc.abstractmethod
    def _update(self, var: DistributedVariable, fn: Callable[..., Any], args: Args, kwargs: Kwargs,
                holders: list[int]) -> list[Any]:
        """Apply ``fn`` to each copy; the results in holder order."""

    # -- datasets ---------------------------------------------------------------------

    def distribute_dataset(self, dataset: Any, options: Any = None) -> DistributedDataset:
        """``experimental_distribute_dataset``: the replicas read ``dataset``'s partitions where they live."""
        from daskdist.data.distributed import DistributedDataset

        self.check_open()
        return DistributedDataset.from_dataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any],
                                          options: Any = None) -> DistributedDataset:
        """Each replica builds its own dataset with ``dataset_fn(InputContext)``."""
        from daskdist.data.distributed import DistributedDataset

        self.check_open()
        return DistributedDataset.from_function(self, dataset_fn, options)

    @abc.abstractmethod
    def register_distributed_dataset(self, dataset_id: str, dataset: Any) -> None:
        """Make a distributed dataset findable by id (unpickled references on the client)."""

    @abc.abstractmethod
    def distributed_dataset(self, dataset_id: str) -> Any:
        """The live distributed dataset ``dataset_id``, or ``None``."""

    # -- context checks ----------------------------------------------------------------

    def _require_cross_replica(self, api: str) -> None:
        """TF's ``_require_cross_replica_or_default_context_extended``."""
        frame = context.current_frame()
        if frame is None:
            return
        if frame.replica_context is None and frame.strategy is self.strategy:
            return
        if frame.strategy is not self.strategy:
            raise RuntimeError(
                f"Mixing different tf.distribute.Strategy objects: {self.strategy!r} is not {frame.strategy!r}"
            )
        raise RuntimeError(
            f"{api}: Method requires being in cross-replica context, use get_replica_context().merge_call()"
        )


# -- helpers ----------------------------------------------------------------------------


def _check_reduce_op(reduce_op: Any) -> ReduceOp:
    if isinstance(reduce_op, VariableAggregation):
        raise TypeError(f"reduce_op must be a dd.ReduceOp (or its name), not the VariableAggregation {reduce_op}")
    return ReduceOp.from_any(reduce_op)


def _is_value_leaf(x: Any) -> bool:
    return isinstance(x, (DistributedValues, DistributedVariable))


def _is_mirrored(value: Any) -> bool:
    return isinstance(value, (Mirrored, MirroredVariable))


def _is_zero(value: Any) -> bool:
    """TF's ``not is_tf_type(value) and value == 0`` for Python and 0-d numbers."""
    if isinstance(value, (bool, int, float)) or (getattr(value, "ndim", None) == 0 and hasattr(value, "dtype")):
        try:
            return bool(value == 0)
        except (TypeError, ValueError):
            return False
    return False


def _destination_count(destinations: Any, extended: StrategyExtended) -> int:
    """On how many devices ``destinations`` lives."""
    if isinstance(destinations, DistributedValues):
        return len(destinations)
    if isinstance(destinations, DistributedVariable):
        if destinations._token == extended.token:
            return len(extended._variable_holders(destinations.var_id))
        return extended.num_replicas
    return 1
