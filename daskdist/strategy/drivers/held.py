"""The step drivers of the strategies that hold parameters off the replicas: ``HolderStepDriver``, ``PsStepDriver``.

See ``training_contract`` for the protocol they implement and how an adapter
uses them. Both keep the trainable's parameters in parameter stores
(``daskdist.ps``) as arrays, with the adapter's update rule; the stores
know no framework.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from daskdist.ps.client import RoundCounter, StoreRef, dedupe_key
from daskdist.strategy.drivers.contract import (
    GradientExchange,
    StatefulTrainable,
    StepDriverBase,
    StepTotals,
    Trainable,
    UpdateRule,
    array_view,
    current_runtime,
    held,
    host,
)

if TYPE_CHECKING:
    from distributed import Client

    from daskdist.group.service import ReplicaService

__all__ = ["AssignRule", "HolderStepDriver", "PsStepDriver"]


class HolderStepDriver(StepDriverBase):
    """Reduce to the parameter holder, apply once there, every replica assigns the result (CentralStorage).

    Parameters
    ----------
    store
        The parameter holder's store.
    key
        The name of the trainable's parameters on the store (one driver, one set of parameters).
    """

    def __init__(self, store: StoreRef, key: str):
        super().__init__()
        self.store = store
        self.key = key
        self._rounds = RoundCounter()

    def _exchange_for(self, trainable: Trainable) -> GradientExchange:
        holder = held(trainable, self)

        def exchange(gradients: Sequence[Any], rows: int, sums: Sequence[float] = (),
                     summed: bool = False) -> None:
            runtime = current_runtime(self)
            arrays = [array_view(g) for g in gradients]
            weighted = [host(g if summed else g * g.dtype.type(rows)) for g in arrays]
            round_id = self._rounds.next(runtime.run_id)
            rule = holder.update_rule()
            init = None
            if runtime.rank == 0 and round_id & 0xFFFFFFFF == 1:  # the store keeps the first it gets
                init = ([np.array(host(array_view(p)), copy=True) for p in holder.parameters()], copy.deepcopy(rule))
            payload = {"grads": weighted, "stats": np.array([float(rows), *(float(s) for s in sums)], np.float64),
                       "lr": _learning_rate(rule), "init": init}
            result = self.store.round_from_replica(runtime, "gradients", f"params:{self.key}", round_id, payload)
            stats = [float(v) for v in result["stats"]]
            self._totals = StepTotals(stats[0], tuple(stats[1:]))
            holder.assign(result["params"])
            return None

        return exchange

    def stored_state(self, client: Client, count: int) -> dict[str, Any] | None:
        """``{"params", "rule_state"}`` of the stored copy (``count`` parameters), or ``None`` before the first step."""
        state: dict[str, Any] | None = self.store.call_from_client(client, "params_state", key=self.key)
        return state

    def set_stored(self, client: Client, count: int, params: list[Any] | None = None,
                   rule_state: dict[str, Any] | None = None) -> bool:
        """Overwrite the stored copy's parameters and/or update-rule state; ``False`` if none is stored yet."""
        return bool(self.store.call_from_client(client, "params_set", key=self.key, params=params,
                                                rule_state=rule_state))

    def init_stored(self, client: Client, params: list[Any], rule: UpdateRule) -> None:
        """Hold ``params`` and a copy of ``rule`` unless held already (else the first round carries replica 0's)."""
        self.store.call_from_client(client, "params_init", key=self.key, params=params, rule=copy.deepcopy(rule))

    def release(self, client: Client) -> None:
        """Drop the stored parameters and update rule (the holder keeps nothing of this key)."""
        self.store.call_from_client(client, "params_drop", key=self.key)

    def __repr__(self) -> str:
        return f"HolderStepDriver({self.store.address!r}, key={self.key!r})"


class PsStepDriver(StepDriverBase):
    """A closure's steps: pull what changed, compute, push; the stores apply (ParameterServerStrategy).

    One driver per worker and trainable, kept with the trainable on the
    worker (it remembers the versions it pulled).

    Parameters
    ----------
    stores
        The parameter stores (parameter ``i`` is held by ``stores[i % len(stores)]``).
    key
        The name of the trainable's parameters on the stores.
    """

    def __init__(self, stores: Sequence[StoreRef], key: str):
        super().__init__()
        self.stores = list(stores)
        self.key = key
        self._versions: list[int] | None = None  # per store, the version of the parameters held here
        self._state_versions: list[int] = [-1] * len(self.stores)  # per store, the version of the state held here
        self._pull_due = True

    @property
    def state_key(self) -> str:
        """The name on the stores of a ``StatefulTrainable``'s state (kept by assignment beside the parameters)."""
        return f"{self.key}:state"

    def layout(self, count: int) -> list[list[int]]:
        """Per store, the indices of the ``count`` parameters it holds (parameter ``i`` on store ``i % stores``)."""
        return [list(range(s, count, len(self.stores))) for s in range(len(self.stores))]

    def begin(self, trainable: Trainable) -> None:
        """A closure starts: its first step pulls what the other workers pushed meanwhile."""
        self._pull_due = True

    def end(self, trainable: Trainable) -> None:
        """A closure ends: a ``StatefulTrainable`` assigns its state on the stores (the last writer's is kept).

        TensorFlow's moving statistics are ps variables each worker assigns
        at every step; here a worker assigns them once per closure (its
        ``steps_per_execution`` steps), and pulls them at the next closure's start.
        """
        state = _state_of(trainable)
        if state is None or self._versions is None:
            return
        runtime = current_runtime(self)
        for s, (store, indices) in enumerate(zip(self.stores, self.layout(len(state)))):
            if indices:
                version, _ = store.call_from_replica(runtime, "params_push", key=self.state_key,
                                                     grads=[host(array_view(state[i])) for i in indices], lr=None)
                self._state_versions[s] = version

    def step(self, trainable: Trainable, batch: Any, rows: int) -> StepTotals:
        if self._versions is None:
            self._offer(trainable)
        if self._pull_due:
            self.pull(trainable)
        return super().step(trainable, batch, rows)

    def _offer(self, trainable: Trainable) -> None:
        """Offer this worker's parameters and update rule to the stores (the first offer is kept)."""
        holder = held(trainable, self)
        runtime = current_runtime(self)
        params = holder.parameters()
        for store, indices in zip(self.stores, self.layout(len(params))):
            if indices:
                store.call_from_replica(runtime, "params_init", key=self.key,
                                        params=[host(array_view(params[i])) for i in indices],
                                        rule=_rule_part(holder.update_rule(), indices))
        state = _state_of(trainable)
        if state is not None:
            for store, indices in zip(self.stores, self.layout(len(state))):
                if indices:
                    store.call_from_replica(runtime, "params_init", key=self.state_key,
                                            params=[host(array_view(state[i])) for i in indices], rule=AssignRule())
        self._versions = [-1] * len(self.stores)
        self._state_versions = [-1] * len(self.stores)

    def pull(self, trainable: Trainable) -> None:
        """Copy in the parameters (and a ``StatefulTrainable``'s state) changed on the stores since this worker
        last saw them."""
        holder = held(trainable, self)
        if self._versions is None:
            self._offer(trainable)
        assert self._versions is not None
        runtime = current_runtime(self)
        values = self._pulled(runtime, self.key, len(holder.parameters()), self._versions)
        if any(v is not None for v in values):
            holder.assign(values)
        state = _state_of(trainable)
        if state is not None:
            values = self._pulled(runtime, self.state_key, len(state), self._state_versions)
            if any(v is not None for v in values):
                cast(StatefulTrainable, trainable).assign_held_state(values)
        self._pull_due = False

    def _pulled(self, service: ReplicaService, key: str, count: int, versions: list[int]) -> list[Any]:
        """The ``count`` arrays held as ``key`` newer than ``versions`` (per store, updated): ``None`` for the rest."""
        values: list[Any] = [None] * count
        for s, (store, indices) in enumerate(zip(self.stores, self.layout(count))):
            if not indices:
                continue
            version, pulled = store.call_from_replica(service, "params_pull", key=key, newer_than=versions[s])
            if pulled is not None:
                for i, value in zip(indices, pulled):
                    values[i] = value
                versions[s] = version
        return values

    def apply_gradients(self, trainable: Trainable, gradients: Sequence[Any]) -> None:
        """A custom loop's ``optimizer.apply``: push ``gradients`` as they are (the stores apply them once, with
        the update rule) and assign the parameters the stores then hold; pulls first if this worker never did."""
        if self._versions is None:
            self.pull(trainable)
        self._exchange_for(trainable)(gradients, 1)

    def _exchange_for(self, trainable: Trainable) -> GradientExchange:
        holder = held(trainable, self)

        def exchange(gradients: Sequence[Any], rows: int, sums: Sequence[float] = (),
                     summed: bool = False) -> None:
            assert self._versions is not None
            self._totals = StepTotals(float(rows), tuple(float(s) for s in sums))
            if rows <= 0:
                return None
            runtime = current_runtime(self)
            arrays = [array_view(g) for g in gradients]
            if summed:
                arrays = [g * g.dtype.type(1.0 / rows) for g in arrays]
            lr = _learning_rate(holder.update_rule())
            values: list[Any] = [None] * len(arrays)
            for s, (store, indices) in enumerate(zip(self.stores, self.layout(len(arrays)))):
                if not indices:
                    continue
                version, new = store.call_from_replica(
                    runtime, "params_push", key=self.key, grads=[host(arrays[i]) for i in indices], lr=lr,
                    dedupe=dedupe_key(runtime), read_version=self._versions[s])
                for i, value in zip(indices, new):
                    values[i] = value
                self._versions[s] = version
            holder.assign(values)
            return None

        return exchange

    # -- the stored copy, from the client ---------------------------------------------------

    def init_stored(self, client: Client, params: list[Any], rule: UpdateRule, state: list[Any] | None = None) -> None:
        """Hold ``params`` and a copy of ``rule`` on the stores (unless held already: the first offer is kept);
        ``state``: a ``StatefulTrainable``'s state, held beside them by assignment."""
        for key, values, make_rule in ((self.key, params, lambda indices: _rule_part(rule, indices)),
                                       (self.state_key, state or [], lambda _indices: AssignRule())):
            for store, indices in zip(self.stores, self.layout(len(values))):
                if indices:
                    store.call_from_client(client, "params_init", key=key, params=[values[i] for i in indices],
                                           rule=make_rule(indices))

    def release(self, client: Client) -> None:
        """Drop this key's parameters, update rules and state from every store (a later ``fit`` holds its own key)."""
        for store in self.stores:
            for key in (self.key, self.state_key):
                store.call_from_client(client, "params_drop", key=key)

    def stored_held_state(self, client: Client, count: int) -> list[Any] | None:
        """The ``count`` state arrays held now (``init_stored``'s ``state``, as workers assigned it), or ``None``."""
        values: list[Any] = [None] * count
        for store, indices in zip(self.stores, self.layout(count)):
            if not indices:
                continue
            state = store.call_from_client(client, "params_state", key=self.state_key)
            if state is None:
                return None
            for i, value in zip(indices, state["params"]):
                values[i] = value
        return values

    def set_stored_held_state(self, client: Client, values: list[Any]) -> bool:
        """Overwrite the state held beside the parameters (``init_stored``'s ``state``) with ``values``: the
        workers pull it at their next closure; ``False`` if a store holds none yet."""
        done = True
        for store, indices in zip(self.stores, self.layout(len(values))):
            if indices:
                done = bool(store.call_from_client(client, "params_set", key=self.state_key,
                                                   params=[values[i] for i in indices])) and done
        return done

    def stored_state(self, client: Client, count: int) -> dict[str, Any] | None:
        """``{"params", "rule_state"}`` gathered from the stores (slots renumbered to the parameters' order)."""
        params: list[Any] = [None] * count
        rule_state: dict[str, Any] = {}
        for store, indices in zip(self.stores, self.layout(count)):
            if not indices:
                continue
            state = store.call_from_client(client, "params_state", key=self.key)
            if state is None:
                return None
            for i, value in zip(indices, state["params"]):
                params[i] = value
            for name, value in state["rule_state"].items():
                slot, _, position = name.rpartition("/")
                if slot and position.isdigit():
                    rule_state[f"{slot}/{indices[int(position)]}"] = value
                else:
                    rule_state.setdefault(name, value)
        return {"params": params, "rule_state": rule_state}

    def set_stored(self, client: Client, count: int, params: list[Any] | None = None,
                   rule_state: dict[str, Any] | None = None) -> bool:
        """Give each store its part of ``params`` / ``rule_state``; ``False`` if a store holds none yet."""
        done = True
        for store, indices in zip(self.stores, self.layout(count)):
            if not indices:
                continue
            part = None if rule_state is None else _state_part(rule_state, indices)
            done = bool(store.call_from_client(client, "params_set", key=self.key,
                                               params=None if params is None else [params[i] for i in indices],
                                               rule_state=part)) and done
        return done

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_versions"], state["_pull_due"] = None, True
        state["_state_versions"] = [-1] * len(self.stores)
        return state

    def __repr__(self) -> str:
        return f"PsStepDriver({len(self.stores)} stores, key={self.key!r})"


class AssignRule:
    """The update rule of a trainable's state on the stores: a push assigns the values (the last writer's kept)."""

    learning_rate = None

    def apply(self, params: list[Any], grads: list[Any]) -> None:
        for target, value in zip(params, grads):
            np.copyto(target, np.asarray(value), casting="unsafe")

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Nothing: the rule keeps no slots."""


def _state_of(trainable: Trainable) -> list[Any] | None:
    """A ``StatefulTrainable``'s state now (``None`` for a trainable without, or with an empty one)."""
    if not isinstance(trainable, StatefulTrainable):
        return None
    state = trainable.held_state()
    return list(state) if state else None


def _learning_rate(rule: UpdateRule) -> float | None:
    """The rule's learning rate for this step, or ``None``: the rule keeps its own (a schedule of its step count)."""
    value = rule.learning_rate
    return None if value is None else float(value)


def _state_part(rule_state: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    """The part of an update rule's state (slots ``<slot>/<i>``) for the parameters ``indices``, renumbered from 0."""
    part = {name: value for name, value in rule_state.items() if not _slot_position(name)}
    for j, i in enumerate(indices):
        part.update({f"{name.rpartition('/')[0]}/{j}": value for name, value in rule_state.items()
                     if _slot_position(name) == str(i)})
    return part


def _rule_part(rule: UpdateRule, indices: list[int]) -> UpdateRule:
    """A copy of ``rule`` for the store holding the parameters ``indices`` (its slots only)."""
    part = copy.deepcopy(rule)
    part.set_state(_state_part(rule.get_state(), indices))
    return part


def _slot_position(name: str) -> str:
    slot, _, position = name.rpartition("/")
    return position if slot and position.isdigit() else ""
