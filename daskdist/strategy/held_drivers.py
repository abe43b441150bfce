"""The step drivers of the strategies that hold parameters off the replicas: ``HolderStepDriver``, ``PsStepDriver``.

See ``training_contract`` for the protocol they implement and how an adapter
uses them. Both keep the trainable's parameters in parameter stores
(``daskdist.ps``) as arrays, with the adapter's update rule; the stores
know no framework.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist.ps.client import RoundCounter, StoreRef, dedupe_key
from daskdist.strategy.training_contract import (
    GradientExchange,
    StepDriverBase,
    StepTotals,
    Trainable,
    UpdateRule,
    as_array,
    current_runtime,
    held,
    host,
)

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["HolderStepDriver", "PsStepDriver"]


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
            arrays = [as_array(g) for g in gradients]
            weighted = [host(g if summed else g * g.dtype.type(rows)) for g in arrays]
            round_id = self._rounds.next(runtime.run_id)
            rule = holder.update_rule()
            init = None
            if runtime.rank == 0 and round_id & 0xFFFFFFFF == 1:  # the store keeps the first it gets
                init = ([np.array(host(as_array(p)), copy=True) for p in holder.parameters()], copy.deepcopy(rule))
            payload = {"grads": weighted, "stats": np.array([float(rows), *(float(s) for s in sums)], np.float64),
                       "lr": float(rule.learning_rate), "init": init}
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
        """Nothing: the first round carries replica 0's parameters and update rule (the replicas hold them)."""

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
        self._pull_due = True

    def layout(self, count: int) -> list[list[int]]:
        """Per store, the indices of the ``count`` parameters it holds (parameter ``i`` on store ``i % stores``)."""
        return [list(range(s, count, len(self.stores))) for s in range(len(self.stores))]

    def begin(self, trainable: Trainable) -> None:
        """A closure starts: its first step pulls what the other workers pushed meanwhile."""
        self._pull_due = True

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
                                        params=[host(as_array(params[i])) for i in indices],
                                        rule=copy.deepcopy(holder.update_rule()))
        self._versions = [-1] * len(self.stores)

    def pull(self, trainable: Trainable) -> None:
        """Copy in the parameters changed on the stores since this worker last saw them."""
        holder = held(trainable, self)
        if self._versions is None:
            self._offer(trainable)
        assert self._versions is not None
        runtime = current_runtime(self)
        count = len(holder.parameters())
        values: list[Any] = [None] * count
        for s, (store, indices) in enumerate(zip(self.stores, self.layout(count))):
            if not indices:
                continue
            version, pulled = store.call_from_replica(runtime, "params_pull", key=self.key,
                                                      newer_than=self._versions[s])
            if pulled is not None:
                for i, value in zip(indices, pulled):
                    values[i] = value
                self._versions[s] = version
        if any(v is not None for v in values):
            holder.assign(values)
        self._pull_due = False

    def _exchange_for(self, trainable: Trainable) -> GradientExchange:
        holder = held(trainable, self)

        def exchange(gradients: Sequence[Any], rows: int, sums: Sequence[float] = (),
                     summed: bool = False) -> None:
            assert self._versions is not None
            self._totals = StepTotals(float(rows), tuple(float(s) for s in sums))
            if rows <= 0:
                return None
            runtime = current_runtime(self)
            arrays = [as_array(g) for g in gradients]
            if summed:
                arrays = [g * g.dtype.type(1.0 / rows) for g in arrays]
            lr = float(holder.update_rule().learning_rate)
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

    def init_stored(self, client: Client, params: list[Any], rule: UpdateRule) -> None:
        """Hold ``params`` and a copy of ``rule`` on the stores (unless held already: the first offer is kept)."""
        for store, indices in zip(self.stores, self.layout(len(params))):
            if indices:
                store.call_from_client(client, "params_init", key=self.key, params=[params[i] for i in indices],
                                       rule=copy.deepcopy(rule))

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
            part = None
            if rule_state is not None:
                part = {name: value for name, value in rule_state.items() if not _slot_position(name)}
                for j, i in enumerate(indices):
                    part.update({f"{name.rpartition('/')[0]}/{j}": value for name, value in rule_state.items()
                                 if _slot_position(name) == str(i)})
            done = bool(store.call_from_client(client, "params_set", key=self.key,
                                               params=None if params is None else [params[i] for i in indices],
                                               rule_state=part)) and done
        return done

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_versions"], state["_pull_due"] = None, True
        return state

    def __repr__(self) -> str:
        return f"PsStepDriver({len(self.stores)} stores, key={self.key!r})"


def _slot_position(name: str) -> str:
    slot, _, position = name.rpartition("/")
    return position if slot and position.isdigit() else ""
