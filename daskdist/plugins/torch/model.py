"""``TorchModel``: a torch module and its optimizer living on every replica, kept by elastic commits.

A handle made on the client installs, on every replica of a strategy, a
resident (kind ``MODEL``) that builds the module and optimizer there with the
user's ``build()``. A function that ``strategy.run`` sends receives, in place
of the handle, its replica's ``TorchReplicaModel``: ``module``, ``optimizer``
and ``ddp()``, the module wrapped in stock ``DistributedDataParallel`` on the
``daskdist`` backend, made once per membership generation (the torch group
initialised for it, the previous wrapper's autograd hooks removed). The
resident snapshots and restores (parameters, buffers, optimizer state, torch's
random state), so ``dd.elastic.State`` commits cover it and a recovery puts it
back on every member before the loop goes on. A commit is copied off the step
path, as the trainer's are (``training.commits``): what the next step's forward
changes (buffers, the random state, the optimizer's hyperparameters) is copied
at the commit, the parameters and the optimizer's state by a thread while the
next step's forward and backward run, and the optimizer's ``step()`` waits for
that copy before it applies (a step pre-hook, ``guard_copy``); so once a step
after a commit showed that the loop changes the weights only in
``optimizer.step()``, and never after one showed it does not::

    model = dd.plugins.torch.TorchModel(strategy, build)     # build() -> (module, optimizer)
    state = dd.elastic.State(strategy, epoch=0, model=model)

    def step(model, x, y):                                   # run by strategy.run on each replica
        ddp = model.ddp()
        model.optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        model.optimizer.step()
"""

from __future__ import annotations

import copy
import gc
import hashlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch

from daskdist import context
from daskdist.group.service import MODEL, ReplicaService
from daskdist.plugins.torch import backend

__all__ = ["TorchModel", "TorchReplicaModel"]

logger = logging.getLogger(__name__)

Build = Callable[[], Any]  # () -> (module, optimizer), or a module alone


class TorchModel:
    """A torch module and optimizer on every replica of ``strategy`` (the client's handle).

    Parameters
    ----------
    strategy
        The strategy whose replicas hold the model (one replica per worker process for ``ddp()``).
    build
        Called once on each replica (picklable): returns ``(module, optimizer)``, or a module
        alone. Seed inside it (``torch.manual_seed``) for equal initial weights; ``ddp()``
        broadcasts rank 0's anyway.

    Notes
    -----
    Captured by a function that ``strategy.run`` sends, the handle arrives on
    each replica as that replica's ``TorchReplicaModel``. Kept among a
    ``dd.elastic.State``'s attributes, it is not copied at commits: the
    replicas' commits hold its state.
    """

    def __init__(self, strategy: Any, build: Build):
        if not callable(build):
            raise TypeError(f"TorchModel needs build: a callable returning (module, optimizer); got {build!r}")
        self._strategy = strategy
        self._model_id = f"torch-{uuid.uuid4().hex[:12]}"
        self._build = build
        strategy.extended.install_resident(MODEL, self._model_id, self.resident())

    @property
    def model_id(self) -> str:
        """The resident's id on the replicas."""
        return self._model_id

    def resident(self) -> TorchReplicaModel:
        """What a replica keeps (built there when unpickled): also what an elastic newcomer is given."""
        return TorchReplicaModel(self._build)

    def state_dict(self, replica: int = 0) -> dict[str, Any]:
        """The module's ``state_dict`` on ``replica`` (tensors copied to the client)."""
        return dict(self._strategy.extended.run_on_replica(replica, _module_state, (self._model_id,)))

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A reference: on a replica of its strategy it resolves to that replica's ``TorchReplicaModel``."""
        return (_resolve, (self._strategy.extended.token, self._model_id))

    def __deepcopy__(self, memo: dict[str, Any]) -> TorchModel:
        return self  # a reference to the replicas' copies (``dd.elastic.State`` copies its plain attributes)

    def __repr__(self) -> str:
        return f"<TorchModel {self._model_id}>"


class TorchReplicaModel:
    """A replica's torch module and optimizer (resident kind ``MODEL``; ``snapshot``/``restore``).

    Attributes
    ----------
    module
        The ``torch.nn.Module`` (unwrapped: its ``state_dict`` keys are the user's).
    optimizer
        The optimizer over ``module``'s parameters, or ``None``.
    """

    def __init__(self, build: Build):
        self._build = build
        self.module: Any = None
        self.optimizer: Any = None
        self._ddp: Any = None
        self._ddp_generation = -1
        self._ddp_runtime: ReplicaService | None = None
        self._copies: list[Callable[[], None]] = []  # the settles of the commits being copied (``guard_copy``)
        self._copies_lock = threading.Lock()
        # whether commits are copied off the step path: not before a step after a commit showed that the loop
        # changes the weights only in optimizer.step(), never after one showed it does not (``_watch_writes``)
        self._off_path: bool | None = None
        self._watched: list[tuple[Any, int]] | None = None  # the tensors' versions at the last commit

    def __getstate__(self) -> dict[str, Any]:
        return {"build": self._build}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["build"])  # type: ignore[misc]
        built = self._build()
        module, optimizer = built if isinstance(built, tuple) else (built, None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"TorchModel's build must return (torch.nn.Module, optimizer); got {type(module)}")
        self.module, self.optimizer = module, optimizer
        if optimizer is not None:  # every apply waits for the commit being copied (``guard_copy``)
            optimizer.register_step_pre_hook(lambda *_: self._before_apply())

    def ddp(self, **kwargs: Any) -> Any:
        """The module in ``DistributedDataParallel`` on the ``daskdist`` backend, for this generation.

        The first call of a membership generation initialises the torch group
        for it (``init_process_group``, unless this replica's code did) and
        wraps the module (``kwargs`` go to ``DistributedDataParallel`` then:
        its construction broadcasts rank 0's parameters and buffers); later
        calls return the same wrapper. A wrapper of an earlier generation is
        dropped first, its autograd hooks removed.
        """
        from torch.nn.parallel import DistributedDataParallel

        runtime = context.current_runtime()
        if runtime is None:
            raise RuntimeError("TorchReplicaModel.ddp() is called inside a function run on the replicas")
        current = backend.is_current(runtime)
        if self._ddp is not None and current and self._ddp_generation == runtime.generation \
                and self._ddp_runtime is runtime:
            return self._ddp
        self.drop_ddp()
        if not current:
            backend.init_process_group()
        self.settle_copies()  # the wrapper's construction writes rank 0's parameters into every replica
        self._ddp = DistributedDataParallel(self.module, **kwargs)
        self._watched = None  # that write is no loop's (``guard_copy``)
        self._ddp_runtime, self._ddp_generation = runtime, runtime.generation
        logger.info("Replica %d wrapped its torch model in DDP for generation %d", runtime.rank, runtime.generation)
        return self._ddp

    def drop_ddp(self) -> None:
        """Forget the DDP wrapper (its autograd hooks removed from the module's parameters), if any."""
        if self._ddp is None:
            return
        ddp, self._ddp, self._ddp_runtime, self._ddp_generation = self._ddp, None, None, -1
        try:
            ddp._remove_autograd_hooks()  # a failed step's traceback may keep the old wrapper alive
        except Exception as e:  # noqa: BLE001 - a torch without it: the reducer's destructor removes them
            logger.debug("Could not remove the old DDP wrapper's hooks: %s", e)
        del ddp
        gc.collect()

    # -- the resident protocol ----------------------------------------------------------

    def snapshot(self) -> TorchState:
        """A copy of the parameters, buffers, optimizer state and torch's random state."""
        return self.begin_snapshot()()

    def begin_snapshot(self) -> Callable[[], TorchState]:
        """A ``snapshot`` in two parts: what a step's forward (or the loop before ``optimizer.step()``) changes,
        copied now (the buffers, extra state, the optimizer's hyperparameters, torch's random state), and the
        function that copies the rest (the parameters and the optimizer's per-parameter state, which only
        ``optimizer.step()`` changes), which an elastic commit calls in a thread while the next step runs.

        That function raises ``RuntimeError`` if a parameter or optimizer tensor changed in place while it
        copied (a write outside ``optimizer.step()``, which ``guard_copy`` cannot hold back).
        """
        module_state = self.module.state_dict()  # the live tensors, detached (copied below)
        parameters = {name for name, _ in self.module.named_parameters()}
        now = {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
               for k, v in module_state.items() if k not in parameters}
        packed = self.optimizer.state_dict() if self.optimizer is not None else None
        groups = copy.deepcopy(packed["param_groups"]) if packed is not None else None
        rng = torch.get_rng_state()
        live = [v for k, v in module_state.items() if k in parameters]
        if packed is not None:
            live += [t for per in packed["state"].values() for t in per.values() if isinstance(t, torch.Tensor)]
        versions = [t._version for t in live]

        def rest() -> TorchState:
            copied = {k: now[k] if k in now else v.detach().clone() for k, v in module_state.items()}
            optimizer_state = None
            if packed is not None:
                optimizer_state = {"state": _cloned(packed["state"]), "param_groups": groups}
            if [t._version for t in live] != versions:
                raise RuntimeError("a parameter or optimizer tensor of a TorchModel changed in place outside "
                                   "optimizer.step() while an elastic commit copied it (between state.commit() "
                                   "and the next optimizer.step()): change the weights only in optimizer.step() "
                                   "or after it")
            return TorchState(copied, optimizer_state, rng)

        return rest

    def guard_copy(self, settle: Callable[[], None]) -> bool:
        """Call ``settle`` (wait for an elastic commit's copy) before anything next writes what the copy reads.

        Returns ``False`` (the commit then waits for its copy at once) for a model without an optimizer (its
        loop changes the weights where no hook sees it), until a step after a commit showed that the loop
        changes the parameters and the optimizer's state only in ``optimizer.step()`` (the first commits),
        and for good once one showed it does not. Else ``True``: the optimizer's step pre-hook, ``ddp()``
        (a new wrapper writes rank 0's weights) and ``restore`` settle first.
        """
        if self.optimizer is None:
            return False
        if self._watched is None and self._off_path is not False:
            self._watched = [(t, t._version) for t in self._state_tensors()]
        if not self._off_path:
            return False
        with self._copies_lock:
            self._copies.append(settle)
        return True

    def _before_apply(self) -> None:
        """The optimizer's step pre-hook: wait for the commits being copied, then look whether the loop wrote
        the weights since the last commit (``guard_copy``)."""
        try:
            self.settle_copies()
        finally:
            self._watch_writes()

    def _watch_writes(self) -> None:
        """Before the first apply after a commit: off the step path from now on if nothing wrote the tensors
        since that commit, else at once for good (``guard_copy``)."""
        watched, self._watched = self._watched, None
        if watched is None or self._off_path is False:
            return
        if all(t._version == version for t, version in watched):
            self._off_path = True
            return
        self._off_path = False
        logger.warning("A TorchModel's loop changed its weights outside optimizer.step() after an elastic commit: "
                       "its commits are copied at once from now on, not off the step path")

    def _state_tensors(self) -> list[Any]:
        """The tensors a commit's thread copies: the parameters and the optimizer's per-parameter state."""
        tensors = [p for p in self.module.parameters()]
        if self.optimizer is not None:
            tensors += [t for per in self.optimizer.state.values() for t in per.values() if isinstance(t, torch.Tensor)]
        return tensors

    def settle_copies(self) -> None:
        """Wait for every commit being copied, then raise what a copy raised (the first)."""
        if not self._copies:
            return
        with self._copies_lock:
            copies, self._copies = self._copies, []
        failed: BaseException | None = None
        for settle in copies:
            try:
                settle()
            except BaseException as e:  # the other copies are still waited for: nothing may write under them
                failed = failed or e
        if failed is not None:
            raise failed

    def restore(self, state: TorchState) -> None:
        """Put back ``state`` (this replica's or a twin's), in place: a DDP wrapper keeps its parameters."""
        self.settle_copies()  # no copy may read what this writes
        self._watched = None  # nor is this write a loop's (``guard_copy``)
        with torch.no_grad():
            self.module.load_state_dict(state.module)
        if self.optimizer is not None and state.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state.optimizer))  # it keeps same-dtype tensors as given
        for p in self.module.parameters():
            p.grad = None  # a failed step's partial gradients
        torch.set_rng_state(state.rng)


class TorchState:
    """A ``TorchReplicaModel``'s snapshot: one leaf for the commit's digest (``digest_bytes``).

    The digest covers the parameters, buffers and optimizer state (what every
    replica must agree on), not the random state (each replica draws its own).
    """

    def __init__(self, module: dict[str, Any], optimizer: dict[str, Any] | None, rng: Any):
        self.module = module
        self.optimizer = optimizer
        self.rng = rng

    def digest_bytes(self) -> bytes:
        digest = hashlib.sha256()
        _digest(digest, self.module)
        _digest(digest, self.optimizer)
        return digest.digest()


def _cloned(value: Any) -> Any:
    """``value`` (tensors in dicts and lists) copied, its tensors by ``clone`` (which lets go of the GIL while
    it copies, where ``copy.deepcopy`` of a tensor holds it: the step beside the copy would wait)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(item) for item in value)
    return copy.deepcopy(value)


def _digest(digest: Any, value: Any) -> None:
    """Feed ``value`` (tensors, dicts, lists, scalars) into ``digest``, in a stable order."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{list(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _digest(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}".encode())
        for item in value:
            _digest(digest, item)
    else:
        digest.update(repr(value).encode())


# -- on the replicas ------------------------------------------------------------------------


def _resolve(token: str, model_id: str) -> TorchReplicaModel:
    """On a replica of the strategy ``token``: its ``TorchReplicaModel`` ``model_id``."""
    runtime = context.current_runtime()
    if runtime is None or runtime.token != token:
        raise RuntimeError(f"TorchModel {model_id} lives on the replicas of strategy {token}: pass it to a function "
                           "that strategy runs (strategy.run)")
    resident = runtime.objects.find(MODEL, model_id)
    if resident is None:
        raise RuntimeError(f"replica {runtime.rank} of {token} holds no TorchModel {model_id!r}")
    model: TorchReplicaModel = resident
    return model


def _module_state(service: ReplicaService, model_id: str) -> dict[str, Any]:
    """Command: the module's ``state_dict`` on this replica (tensors copied)."""
    module = service.objects.get(MODEL, model_id).module
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
