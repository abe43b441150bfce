"""Keras' own ``TensorBoard`` callback without TensorFlow: its summaries written through ``tensorboardX``.

Keras 3's ``keras.callbacks.TensorBoard`` writes with ``tensorflow.summary``,
which the torch backend does not install, so the tutorial's first callback
fails in plain Keras there. When TensorFlow cannot be imported, ``install``
gives the callback this module's small ``tf.summary`` stand-in (file writers,
scalars, histograms, text; graphs, traces and images are skipped) and writes
the model summary as text. The event files are TensorBoard's own format.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["SummaryModule", "install", "tensorflow_available"]

_local = threading.local()


def tensorflow_available() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


class _FileWriter:
    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir)
        self.step: int | None = None

    @contextlib.contextmanager
    def as_default(self, step: int | None = None) -> Iterator[_FileWriter]:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append((self, step))
        try:
            yield self
        finally:
            stack.pop()
            self.writer.flush()

    def set_as_default(self, step: int | None = None) -> None:
        _local.stack = [*getattr(_local, "stack", []), (self, step)]

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _current(step: int | None) -> tuple[_FileWriter | None, int | None]:
    stack = getattr(_local, "stack", None)
    if not stack:
        return None, step
    writer, default_step = stack[-1]
    return writer, step if step is not None else default_step


class SummaryModule:
    """The part of ``tf.summary`` Keras' ``TensorBoard`` callback uses, over ``tensorboardX``."""

    @staticmethod
    def create_file_writer(logdir: str, **unused: Any) -> _FileWriter:
        return _FileWriter(logdir)

    @staticmethod
    def scalar(name: str, data: Any, step: int | None = None, description: str | None = None) -> bool:
        writer, step = _current(step)
        if writer is None:
            return False
        writer.writer.add_scalar(name, float(np.asarray(data)), step)
        return True

    @staticmethod
    def histogram(name: str, data: Any, step: int | None = None, **unused: Any) -> bool:
        writer, step = _current(step)
        if writer is None:
            return False
        writer.writer.add_histogram(name, np.asarray(data, dtype=np.float64), step)
        return True

    @staticmethod
    def text(name: str, data: Any, step: int | None = None, **unused: Any) -> bool:
        writer, step = _current(step)
        if writer is None:
            return False
        writer.writer.add_text(name, str(data), step)
        return True

    @staticmethod
    def image(*args: Any, **kwargs: Any) -> bool:  # weight images: skipped
        return False

    @staticmethod
    def graph(*args: Any, **kwargs: Any) -> None:  # TF graphs only
        return None

    @staticmethod
    def trace_on(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def trace_export(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def record_if(condition: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _model_summary(name: str, data: Any, step: int | None = None) -> bool:
    """``keras_model_summary`` of Keras' callback: the model's configuration as text."""
    try:
        config = json.dumps(data.get_config(), default=str, indent=1)
    except Exception:  # a model without a serializable config: nothing to write
        return False
    return SummaryModule.text(name, f"```\n{config}\n```", step)


def install() -> None:
    """Give Keras' ``TensorBoard`` callback the ``tensorboardX`` writer when TensorFlow is not installed."""
    if tensorflow_available() or importlib.util.find_spec("tensorboardX") is None:
        return
    from keras.src.callbacks import tensorboard

    original = tensorboard.TensorBoard.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._summary_module = SummaryModule

    tensorboard.TensorBoard.__init__ = __init__
    tensorboard.keras_model_summary = _model_summary
