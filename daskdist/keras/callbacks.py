"""Keras callbacks, run on the client at epoch boundaries (and fed progress as replicas train).

Epoch hooks run synchronously between epochs. A user's batch hooks
(``on_train_batch_begin/end``) run between commands of ``steps_per_execution``
steps (the trainer's ``STEPWISE`` runner, ``training.runner_choice``); they
are refused under an elastic strategy and under ParameterServerStrategy. The
progress bar's ``on_train_batch_end`` is fed by replica 0's progress reports
as they arrive, asynchronously: the replicas do not wait for it.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from daskdist.keras import saving

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "TensorBoard",
]

logger = logging.getLogger(__name__)


class Callback:
    """Base class with TensorFlow's hooks; ``self.model`` and ``self.params`` are set before training."""

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None: ...


class History(Callback):
    """Records every epoch's logs in ``history`` (returned by ``fit``)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []
        #: On an elastic strategy: the fit's ``daskdist.keras.elastic_fit.ElasticFit`` (its ``ledger``, its ``events``).
        self.elastic: Any = None
        #: On an elastic strategy: every membership change the fit survived (lost, admitted, commit, seconds).
        self.elastic_events: list[dict[str, Any]] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


class ProgbarLogger(Callback):
    """A Keras-like progress bar (``tqdm.auto``: a widget in Jupyter, a text bar in a terminal)."""

    def __init__(self, verbose: int = 1):
        super().__init__()
        self.verbose = verbose
        self._bar: Any = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.verbose != 1:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=self.params.get("steps"), desc=f"Epoch {epoch + 1}/{self.params.get('epochs')}",
                         unit="step", leave=True, dynamic_ncols=True)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        bar = self._bar
        if bar is None or batch < 0:
            return
        bar.update(max(0, batch - bar.n))
        if logs:
            bar.set_postfix({k: f"{v:.4f}" for k, v in logs.items()}, refresh=False)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        text = " - ".join(f"{k}: {v:.4f}" for k, v in (logs or {}).items())
        if self._bar is not None:
            if self._bar.total:
                self._bar.update(self._bar.total - self._bar.n)
            self._bar.set_postfix_str(text)
            self._bar.close()
            self._bar = None
        elif self.verbose == 2:
            from tqdm.auto import tqdm

            tqdm.write(f"Epoch {epoch + 1}/{self.params.get('epochs')} - {text}")


def is_default(method: Any) -> bool:
    """Whether a callback's bound hook is ``Callback``'s own no-op (not overridden)."""
    return getattr(method, "__func__", None) is getattr(Callback, getattr(method, "__name__", ""), None)


class CallbackList:
    """Calls every callback's hook in order; owns the progress bar."""

    def __init__(self, callbacks: list[Callback], model: Any, verbose: int, params: dict[str, Any]):
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be dd.keras.callbacks.Callback instances, got {type(cb).__name__}")
        self.callbacks = list(callbacks)
        if verbose:  # first, as in Keras: the epoch's summary shows before other callbacks print
            self.callbacks.insert(0, ProgbarLogger(verbose))
        for cb in self.callbacks:
            cb.set_model(model)
            cb.set_params(params)

    def wants_progress(self) -> bool:
        overridden = [cb for cb in self.callbacks
                      if type(cb).on_train_batch_end is not Callback.on_train_batch_end]
        return bool(overridden)

    def on_progress(self, step: int, logs: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_train_batch_end(step, logs)

    def resume_epoch(self) -> int:
        return max([getattr(cb, "resume_epoch", 0) for cb in self.callbacks] + [0])

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any, **kwargs: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args, **kwargs)

        return call


class ModelCheckpoint(Callback):
    """Save the model (or its weights) after every epoch, or only the best (Keras' ``ModelCheckpoint``).

    ``filepath`` may hold ``{epoch}`` (1-based, as in Keras) and any log name
    (``{val_loss:.2f}``). Files are safetensors + JSON, written atomically.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0, save_best_only: bool = False,
                 save_weights_only: bool = False, mode: str = "auto", save_freq: str = "epoch"):
        super().__init__()
        if save_freq != "epoch":
            raise ValueError("only save_freq='epoch' is supported")
        self.filepath = os.fspath(filepath)
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.better, self.best = _comparator(mode, monitor)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs or {}
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                logger.warning("ModelCheckpoint: %s is not in the logs (%s); skipping", self.monitor, sorted(logs))
                return
            if not self.better(current, self.best):
                return
            self.best = current
        path = self.filepath.format(epoch=epoch + 1, **logs)
        if self.save_weights_only:
            self.model.save_weights(path)
        else:
            self.model.save(path)
        logger.info("Epoch %d: saved %s", epoch + 1, path)


def _comparator(mode: str, monitor: str) -> tuple[Callable[[float, float], bool], float]:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode == "max" or (mode == "auto" and ("acc" in monitor or monitor.startswith("fmeasure"))):
        return (lambda current, best: current > best), -math.inf
    return (lambda current, best: current < best), math.inf


class LearningRateScheduler(Callback):
    """Set ``model.optimizer.lr = schedule(epoch, lr)`` at the start of every epoch."""

    def __init__(self, schedule: Callable[..., float], verbose: int = 0):
        super().__init__()
        self.schedule = schedule
        self.verbose = verbose

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        current = float(self.model.optimizer.learning_rate)
        try:
            lr = self.schedule(epoch, current)
        except TypeError:  # a schedule that takes only the epoch
            lr = self.schedule(epoch)
        lr = float(lr)
        if not math.isfinite(lr):
            raise ValueError(f"the schedule returned a learning rate that is not finite: {lr}")
        self.model.optimizer.learning_rate = lr

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(self.model.optimizer.learning_rate)


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs."""

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0, verbose: int = 0,
                 mode: str = "auto", baseline: float | None = None, restore_best_weights: bool = False):
        super().__init__()
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self._better, _ = _comparator(mode, monitor)
        self.stopped_epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.wait = 0
        self.best = self.baseline
        self.best_weights = None
        self.stopped_epoch = 0

    def _improved(self, current: float) -> bool:
        if self.best is None:
            return True
        if self._better(1.0, 0.0):  # higher is better
            return current - self.min_delta > self.best
        return current + self.min_delta < self.best

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        current = (logs or {}).get(self.monitor)
        if current is None:
            logger.warning("EarlyStopping: %s is not in the logs (%s)", self.monitor, sorted(logs or {}))
            return
        if self._improved(current):
            self.best = current
            self.wait = 0
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self.restore_best_weights and self.best_weights is not None:
                self.model.set_weights(self.best_weights)


class BackupAndRestore(Callback):
    """Back up the training state every epoch; an interrupted ``fit`` resumes at the next epoch.

    The backup (weights, optimizer state, last finished epoch) is written
    atomically to ``backup_dir`` and deleted when training finishes.
    """

    def __init__(self, backup_dir: str, delete_checkpoint: bool = True):
        super().__init__()
        if not backup_dir:
            raise ValueError("backup_dir is required")
        self.backup_dir = os.fspath(backup_dir)
        self.delete_checkpoint = delete_checkpoint
        self.resume_epoch = 0

    @property
    def _prefix(self) -> str:
        return os.path.join(self.backup_dir, "backup")

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.resume_epoch = 0
        if os.path.exists(self._prefix + ".json"):
            self.model.load_weights(self._prefix)
            state = saving.read_json(os.path.join(self.backup_dir, "state.json"))
            self.resume_epoch = int(state["epoch"]) + 1
            logger.info("BackupAndRestore: resuming after epoch %d", self.resume_epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.model.save_weights(self._prefix)
        saving.write_json(os.path.join(self.backup_dir, "state.json"), {"epoch": epoch})

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.delete_checkpoint and not self.model.stop_training and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir, ignore_errors=True)


class TensorBoard(Callback):
    """Write the epoch logs as TensorBoard event files (``tensorboardX``) under ``log_dir/train`` and ``/validation``."""

    def __init__(self, log_dir: str = "logs", update_freq: str = "epoch", **unused: Any):
        super().__init__()
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writers: dict[str, Any] = {}

    def _writer(self, split: str) -> Any:
        if split not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[split] = SummaryWriter(os.path.join(self.log_dir, split))
        return self._writers[split]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        for key, value in (logs or {}).items():
            if not isinstance(value, (int, float, np.floating, np.integer)):
                continue
            split, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self._writer(split).add_scalar(f"epoch_{name}", float(value), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
