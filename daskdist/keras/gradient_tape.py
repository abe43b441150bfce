"""``GradientTape``: gradients of a loss in a custom training loop over the built-in layers (TF's tape).

::

    with dd.GradientTape() as tape:
        predictions = model(x, training=True)
        loss = dd.nn.compute_average_loss(loss_object(y, predictions), global_batch_size=64)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

While a tape is open, a model call returns a :class:`TapeTensor` (a numpy
array that remembers where it came from), a loss call records its gradient,
and arithmetic on tape tensors (``+ - * /``, unary ``-``, ``** c``,
``sum``, ``mean``, ``reshape``) is recorded too. ``tape.gradient`` walks the
record backwards: through the arithmetic with the chain rule, through each
loss with the loss's own gradient, and through each model with its layers'
explicit backward pass, which fills the gradients of the model's
parameters. Nothing else is differentiated: a target computed by any other
operation raises ``ValueError`` saying so (TensorFlow would return ``None``
gradients). The tape records numpy arrays; cupy outputs raise
``NotImplementedError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["GradientTape", "TapeTensor", "active_tape", "record_loss", "record_model_call"]

Array = Any
Vjp = Callable[[np.ndarray], np.ndarray]

_local = threading.local()


def _stack() -> list[GradientTape]:
    stack = getattr(_local, "tapes", None)
    if stack is None:
        stack = _local.tapes = []
    return stack


def active_tape() -> GradientTape | None:
    """The innermost open tape of this thread, or ``None``."""
    stack = _stack()
    return stack[-1] if stack else None


@dataclass(eq=False)
class _Node:
    """One recorded value: its parents with the vector-Jacobian product towards each, or a model call."""

    tape: GradientTape
    parents: tuple[tuple[_Node, Vjp], ...] = ()
    model: Any = None  # a model-output node: the model whose backward pass gives its parameters' gradients
    call: int = 0  # which call of that model (its layers cache only the last one)
    input_node: _Node | None = None  # the model's input, when it was itself recorded (models chained)
    shape: tuple[int, ...] = field(default=())


class TapeTensor(np.ndarray):
    """A numpy array computed under a :class:`GradientTape`; operations on it are recorded.

    It pickles (and ``np.asarray`` gives) a plain numpy array.
    """

    _tape_node: _Node | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._tape_node = None  # views and copies made by numpy are not recorded

    def __reduce__(self) -> Any:
        return np.asarray(self).copy().__reduce__()

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        plain = [np.asarray(i) if isinstance(i, TapeTensor) else i for i in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, TapeTensor) else o for o in kwargs["out"])
        result = getattr(ufunc, method)(*plain, **kwargs)
        rule = _RULES.get(ufunc.__name__) if method == "__call__" and "out" not in kwargs else None
        if method == "reduce" and ufunc is np.add and "out" not in kwargs:
            return _record_sum(inputs[0], result, kwargs.get("axis", 0), bool(kwargs.get("keepdims", False)))
        if rule is None:
            return result  # not recorded: a target built from it has no gradient
        parents = []
        for index, value in enumerate(inputs):
            node = _node_of(value)
            if node is not None:
                parents.append((node, _unbroadcast(rule(index, plain, result), np.shape(value))))
        return _wrap(result, parents)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.sum:
            return args[0].sum(*args[1:], **kwargs)
        if func is np.mean:
            return args[0].mean(*args[1:], **kwargs)
        return super().__array_function__(func, types, args, kwargs)

    # numpy's stubs type ndarray.sum and ndarray.mean as overloads that one recording signature cannot restate
    def sum(self, axis: Any = None, dtype: Any = None, out: Any = None,  # type: ignore[override]
            keepdims: bool = False, **kwargs: Any) -> Any:
        if out is not None or kwargs:
            return np.asarray(self).sum(axis=axis, dtype=dtype, out=out, keepdims=keepdims, **kwargs)
        result = np.asarray(self).sum(axis=axis, dtype=dtype, keepdims=keepdims)
        return _record_sum(self, result, axis, keepdims)

    def mean(self, axis: Any = None, dtype: Any = None, out: Any = None,  # type: ignore[override]
             keepdims: bool = False, **kwargs: Any) -> Any:
        if out is not None or kwargs:
            return np.asarray(self).mean(axis=axis, dtype=dtype, out=out, keepdims=keepdims, **kwargs)
        total = self.sum(axis=axis, dtype=dtype, keepdims=keepdims)
        count = max(self.size // max(np.asarray(total).size, 1), 1)
        return total / np.asarray(total).dtype.type(count)

    def reshape(self, *shape: Any, **kwargs: Any) -> Any:
        result = np.asarray(self).reshape(*shape, **kwargs)
        node = _node_of(self)
        if node is None:
            return result
        source_shape = self.shape
        return _wrap(result, [(node, lambda g: np.reshape(g, source_shape))])


def _raw_node(value: Any) -> _Node | None:
    return getattr(value, "_tape_node", None) if isinstance(value, TapeTensor) else None


def _node_of(value: Any) -> _Node | None:
    """The node of ``value`` if its tape is still recording (operations after ``with tape:`` are not)."""
    node = _raw_node(value)
    return node if node is not None and node.tape._recording else None


def _wrap(value: Any, parents: Sequence[tuple[_Node, Vjp]], **node_fields: Any) -> Any:
    if not parents and not node_fields:
        return value
    tape = parents[0][0].tape if parents else node_fields["tape"]
    node_fields.setdefault("tape", tape)
    out = np.asarray(value).view(TapeTensor)
    out._tape_node = _Node(parents=tuple(parents), shape=out.shape, **node_fields)
    return out


def _record_sum(source: Any, result: Any, axis: Any, keepdims: bool) -> Any:
    node = _node_of(source)
    if node is None:
        return result
    shape = np.shape(source)
    axes = tuple(range(len(shape))) if axis is None else tuple(a % len(shape) for a in np.atleast_1d(axis))

    def vjp(g: np.ndarray) -> np.ndarray:
        g = np.asarray(g)
        if not keepdims:
            g = np.expand_dims(g, axes)
        return np.broadcast_to(g, shape)

    return _wrap(result, [(node, vjp)])


def _unbroadcast(grad_of: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...]) -> Vjp:
    """A vjp whose result is summed back to ``shape`` over the axes numpy broadcast."""

    def vjp(g: np.ndarray) -> np.ndarray:
        grad = np.asarray(grad_of(g))
        while grad.ndim > len(shape):
            grad = grad.sum(axis=0)
        for axis, size in enumerate(shape):
            if size == 1 and grad.shape[axis] != 1:
                grad = grad.sum(axis=axis, keepdims=True)
        return grad

    return vjp


def _rule_add(i: int, x: list[Any], out: Any) -> Callable[[np.ndarray], np.ndarray]:
    return lambda g: g


def _rule_subtract(i: int, x: list[Any], out: Any) -> Callable[[np.ndarray], np.ndarray]:
    return (lambda g: g) if i == 0 else (lambda g: -g)


def _rule_multiply(i: int, x: list[Any], out: Any) -> Callable[[np.ndarray], np.ndarray]:
    other = x[1 - i]
    return lambda g: g * other


def _rule_divide(i: int, x: list[Any], out: Any) -> Callable[[np.ndarray], np.ndarray]:
    a, b = x
    return (lambda g: g / b) if i == 0 else (lambda g: -g * a / (b * b))


def _rule_negative(i: int, x: list[Any], out: Any) -> Callable[[np.ndarray], np.ndarray]:
    return lambda g: -g


def _rule_power(i: int, x: list[Any], out: Any) -> Callable[[np.ndarray], np.ndarray]:
    base, exponent = x
    if i == 0:
        return lambda g: g * exponent * np.power(base, exponent - 1)
    return lambda g: g * out * np.log(base)


def _rule_square(i: int, x: list[Any], out: Any) -> Callable[[np.ndarray], np.ndarray]:
    return lambda g: 2 * g * x[0]


_RULES: dict[str, Callable[[int, list[Any], Any], Callable[[np.ndarray], np.ndarray]]] = {
    "add": _rule_add, "subtract": _rule_subtract, "multiply": _rule_multiply, "true_divide": _rule_divide,
    "divide": _rule_divide, "negative": _rule_negative, "power": _rule_power, "square": _rule_square,
}


def record_model_call(model: Any, x: Any, output: Any) -> Any:
    """Under an open tape: ``output`` of ``model`` as a :class:`TapeTensor` whose gradient runs its backward."""
    tape = active_tape()
    if tape is None or not tape._recording:
        return output
    if not isinstance(output, np.ndarray):
        raise NotImplementedError(
            f"GradientTape records numpy arrays; the model returned {type(output).__module__}."
            f"{type(output).__name__} (on a GPU, train with fit)"
        )
    calls = tape._model_calls.get(id(model), 0) + 1
    tape._model_calls[id(model)] = calls
    tape._models[id(model)] = model
    return _wrap(output, [], tape=tape, model=model, call=calls, input_node=_node_of(x))


def record_loss(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any, reduction: str) -> Any:
    """Under an open tape: the loss value of a recorded ``y_pred``, whose gradient is ``loss.gradient``.

    ``reduction`` is ``"none"`` (per-example losses), ``"sum"`` or
    ``"sum_over_batch_size"`` (Keras' default: the batch mean).
    """
    node = _node_of(y_pred)
    pred = np.asarray(y_pred)
    per = loss.per_example(y_true, pred)
    weight = None
    if sample_weight is not None:
        weight = np.asarray(sample_weight, dtype=per.dtype).reshape(-1)
        per = per * weight
    if reduction == "none":
        value = per
    elif reduction == "sum":
        value = per.sum()
    else:
        value = per.sum() / per.dtype.type(max(per.shape[0], 1))
    if node is None:
        return value
    batch = max(per.shape[0], 1)

    def vjp(g: np.ndarray) -> np.ndarray:
        g = np.asarray(g, dtype=pred.dtype)
        per_example = np.broadcast_to(g, per.shape) if reduction == "none" else np.full(per.shape, g, pred.dtype)
        if reduction in ("sum_over_batch_size", "auto"):
            per_example = per_example / pred.dtype.type(batch)
        if weight is not None:
            per_example = per_example * weight
        grad: np.ndarray = loss.gradient(y_true, pred)
        weighted: np.ndarray = grad * per_example.reshape((-1,) + (1,) * (grad.ndim - 1))
        return weighted

    return _wrap(value, [(node, vjp)])


class GradientTape:
    """Records model calls, losses and arithmetic on their results; :meth:`gradient` differentiates them.

    Parameters
    ----------
    persistent
        Allow several :meth:`gradient` calls (TF's argument). With the
        default ``False`` a second call raises ``RuntimeError``, as in TF.
    watch_accessed_variables
        Accepted for TF's signature: a model's parameters are always watched.

    Notes
    -----
    A model's layers keep the caches of their *last* forward pass only, so
    a model called twice under one tape can give gradients for its last
    call only; a gradient through an earlier call raises ``ValueError``.
    """

    def __init__(self, persistent: bool = False, watch_accessed_variables: bool = True):
        self.persistent = bool(persistent)
        self.watch_accessed_variables = bool(watch_accessed_variables)
        self._recording = False
        self._used = False
        self._model_calls: dict[int, int] = {}
        self._models: dict[int, Any] = {}
        self._param_grads: dict[int, Any] = {}

    def __enter__(self) -> GradientTape:
        self._recording = True
        _stack().append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._recording = False
        stack = _stack()
        if self in stack:
            stack.remove(self)

    def watch(self, tensor: Any) -> None:
        """Accepted for TF's API: model parameters are always watched; other tensors need no watching."""

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: str = "none") -> Any:
        """The gradient of ``target`` with respect to each of ``sources`` (same structure as ``sources``).

        Parameters
        ----------
        target
            A value computed under this tape (usually the scalar loss).
        sources
            Arrays of ``model.trainable_variables`` (a list, or one array),
            or tape tensors computed under this tape (e.g. a model output).
        output_gradients
            The gradient flowing into ``target`` (default: ones).
        unconnected_gradients
            ``"none"`` (a source the target does not depend on gets ``None``,
            as in TF) or ``"zero"``.

        Raises
        ------
        ValueError
            ``target`` was not computed under this tape from a model call.
        RuntimeError
            A second call on a non-persistent tape.
        """
        if self._used and not self.persistent:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one set of gradients "
                               "(or jacobians)")
        self._used = True
        root = _raw_node(target)
        if root is None or root.tape is not self:
            raise ValueError(
                "GradientTape.gradient: the target was not computed under this tape from a model call: record the "
                "model call, the loss and any arithmetic (+ - * /, sum, mean, reshape) inside `with tape:`; other "
                "operations are not differentiated"
            )
        grads = self._backpropagate(root, output_gradients, np.asarray(target))
        single = not isinstance(sources, (list, tuple))
        listed = [sources] if single else list(sources)
        out = [self._gradient_of(s, grads, unconnected_gradients) for s in listed]
        return out[0] if single else (tuple(out) if isinstance(sources, tuple) else out)

    # -- internals -------------------------------------------------------------------------------------------

    def _backpropagate(self, root: _Node, output_gradients: Any, value: np.ndarray) -> dict[int, Any]:
        order = _topological(root)
        seed = np.ones_like(value) if output_gradients is None else np.asarray(output_gradients, value.dtype)
        grads: dict[int, Any] = {id(root): seed}
        self._param_grads = {}
        for node in reversed(order):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            grads[id(node)] = g  # kept for sources that are tape tensors
            for parent, vjp in node.parents:
                _accumulate(grads, parent, vjp(g))
            if node.model is not None:
                self._model_backward(node, g, grads)
        return grads

    def _model_backward(self, node: _Node, g: Any, grads: dict[int, Any]) -> None:
        model = node.model
        if self._model_calls.get(id(model)) != node.call:
            raise ValueError(
                f"GradientTape.gradient: {type(model).__name__} {model.name!r} was called "
                f"{self._model_calls[id(model)]} times under this tape and the target depends on call {node.call}; "
                "its layers keep the last call's intermediate values only: call it once per tape"
            )
        grad_x = model._backward(np.asarray(g, dtype=node_dtype(model, g)))
        for layer in model.layers:
            for name, p in layer.params.items():
                pg = layer.grads[name]
                key = id(p)
                self._param_grads[key] = pg if key not in self._param_grads else self._param_grads[key] + pg
        if node.input_node is not None and grad_x is not None:
            _accumulate(grads, node.input_node, grad_x)

    def _gradient_of(self, source: Any, grads: dict[int, Any], unconnected: str) -> Any:
        node = _raw_node(source)
        if node is not None:
            g = grads.get(id(node))
        else:
            g = self._param_grads.get(id(source))
        if g is None and unconnected == "zero":
            return np.zeros_like(np.asarray(source))
        return g


def node_dtype(model: Any, g: Any) -> Any:
    """The dtype the model's backward pass takes: its last layer's (``float32`` by default)."""
    layers = getattr(model, "layers", None)
    return np.dtype(layers[-1].dtype) if layers else np.asarray(g).dtype


def _accumulate(grads: dict[int, Any], node: _Node, g: Any) -> None:
    key = id(node)
    grads[key] = g if key not in grads else grads[key] + g


def _topological(root: _Node) -> list[_Node]:
    """Every node ``root`` depends on, parents before children (iterative: deep records do not recurse)."""
    order: list[_Node] = []
    seen: set[int] = set()
    stack: list[tuple[_Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for parent, _ in node.parents:
            if id(parent) not in seen:
                stack.append((parent, False))
        if node.input_node is not None and id(node.input_node) not in seen:
            stack.append((node.input_node, False))
    return order
