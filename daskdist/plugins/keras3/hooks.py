"""How ``model.fit`` of a real Keras 3 model reaches daskdist: a few wrapped methods of Keras' classes.

Installed once, when ``keras`` is imported in a process that imported
``daskdist`` (either order; ``install`` is idempotent):

* ``Model.__init__`` (and ``Functional.__init__``): a model created in a
  daskdist ``strategy.scope()`` on the client is recorded as that strategy's
  (``registry``), as TensorFlow records ``model._distribution_strategy``; an
  unsupported backend is refused right there.
* ``Model.compile/fit/evaluate/predict``: for a recorded model they run on the
  strategy's replicas (``fit.py``); a model created outside every scope and
  compiled or trained inside one is refused, as TensorFlow refuses it; every
  other model runs Keras' own code untouched.
* ``Model.save/save_weights`` (and ``get_weights`` of each recorded model,
  bound on that model only: ``fit.created``): a recorded model first takes its
  replicas' weights when a custom loop may have changed them.
* ``Optimizer.__init__`` records optimizers created in a scope;
  ``Optimizer.apply`` exchanges gradients on the replicas (``exchange.py``);
  ``Optimizer.stateless_apply`` hands out the gradients of a JAX step's
  first half (``exchange.captured``, ``backend_jax``).
* ``TensorBoard`` writes through ``tensorboardX`` where TensorFlow is not installed (``tensorboard.py``).
* ``__reduce_ex__`` of recorded models and optimizers: inside
  ``strategy.run(fn)`` a captured model or optimizer travels as a reference to
  the replica's own copy (as distributed variables do).
* ``Metric.__init__`` records metrics created in a strategy's scope, and their
  ``__reduce_ex__`` makes them references in scheduled functions
  (``ParameterServerStrategy``: ``ps_metrics.py``) or in ``strategy.run``
  (``replica_metrics.py``) whose updates count on the client's metric.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from daskdist.plugins.keras3 import wrapped

__all__ = ["install", "install_when_imported", "installed"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_installed = False


def installed() -> bool:
    """Whether Keras' classes are wrapped in this process."""
    return _installed


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Wrap ``name`` where ``cls`` finds it (its defining class: Keras compares ``cls.compile`` with
    ``Trainer.compile`` to tell a user's override, and the wrapped method must still be Keras' own)."""
    owner = next((c for c in cls.__mro__ if name in c.__dict__), cls)
    if owner is object:
        owner = cls
    original = owner.__dict__.get(name) or getattr(cls, name)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__daskdist_original__ = original  # type: ignore[attr-defined]  # typeshed: a function has no such attribute
    setattr(owner, name, wrapper)


def install() -> None:
    """Wrap Keras' ``Model`` and ``Optimizer`` methods (once per process; needs ``keras`` importable)."""
    global _installed
    with _lock:
        if _installed:
            return
        from keras.src.metrics.metric import Metric
        from keras.src.models.functional import Functional
        from keras.src.models.model import Model
        from keras.src.optimizers.base_optimizer import BaseOptimizer
        from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

        from daskdist.plugins.keras3 import exchange, fit, ps_metrics, replica_metrics, tensorboard

        def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                fit.created(self)
            return __init__

        _wrap(Model, "__init__", make_init)
        _wrap(Functional, "__init__", make_init)

        for name in ("compile", "fit", "evaluate", "predict", "save", "save_weights"):
            handler = getattr(fit, name)

            def make_method(original: Callable[..., Any], handler: Callable[..., Any] = handler) -> Callable[..., Any]:
                def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                    return handler(original, self, *args, **kwargs)
                return method

            _wrap(Model, name, make_method)

        def make_reduce(original: Callable[..., Any]) -> Callable[..., Any]:
            def __reduce_ex__(self: Any, protocol: Any) -> Any:
                reference = fit.reference(self)
                return reference if reference is not None else original(self, protocol)
            return __reduce_ex__

        _wrap(Model, "__reduce_ex__", make_reduce)
        _wrap(BaseOptimizer, "__reduce_ex__", make_reduce)
        _wrap(Metric, "__reduce_ex__", make_reduce)

        def make_metric_init(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                ps_metrics.created(self)
                replica_metrics.created(self)
            return __init__

        _wrap(Metric, "__init__", make_metric_init)

        def make_optimizer_init(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                fit.created_optimizer(self)
            return __init__

        _wrap(BaseOptimizer, "__init__", make_optimizer_init)

        def make_apply(original: Callable[..., Any]) -> Callable[..., Any]:
            def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
                return exchange.apply_with_exchange(self, grads, trainable_variables, original)
            return apply

        _wrap(BaseOptimizer, "apply", make_apply)
        # a mixed_float16 model's optimizer (Keras' compile wraps it): its own apply exchanges the scaled gradients
        # before it unscales them and applies with the inner optimizer (whose apply is then Keras' own)
        _wrap(LossScaleOptimizer, "apply", make_apply)

        def make_stateless_apply(original: Callable[..., Any]) -> Callable[..., Any]:
            def stateless_apply(self: Any, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
                return exchange.stateless_apply_with_capture(self, optimizer_variables, grads, trainable_variables,
                                                             original)
            return stateless_apply

        _wrap(BaseOptimizer, "stateless_apply", make_stateless_apply)
        _wrap(LossScaleOptimizer, "stateless_apply", make_stateless_apply)
        tensorboard.install()
        _installed = True
        logger.debug("daskdist: Keras 3 Model and Optimizer methods wrapped")


class _AfterKerasImport:
    """A one-shot import hook: ``install()`` right after ``import keras`` finishes.

    It leaves ``sys.meta_path`` when Keras has been executed, not when asked
    for a spec: ``importlib.util.find_spec("keras")`` (a check that Keras is
    installed, which imports nothing) must not use it up.
    """

    def __init__(self) -> None:
        self._looking = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "keras" or self._looking:
            return None
        import importlib.util

        self._looking = True  # the finders after this one find Keras' own spec
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                install()
            except Exception:  # a Keras without a backend here: model.fit stays Keras' own
                logger.warning("daskdist could not wrap Keras' classes", exc_info=True)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # typeshed: Loader's methods are read-only
        return spec


def install_when_imported() -> None:
    """``install()`` now if ``keras`` is imported, else as soon as it is."""
    if "keras" in sys.modules:
        try:
            install()
        except Exception:  # pragma: no cover - a Keras that failed to import its backend
            logger.warning("daskdist could not wrap Keras' classes", exc_info=True)
        return
    if not any(isinstance(finder, _AfterKerasImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())


wrapped.set_installer(install)  # the modules below this one wrap Keras' classes on a worker through it
