"""What differs on Keras' torch backend: a step with its gradients exchanged, tensors <-> numpy, threads.

Keras' torch ``Model.train_step`` runs forward, ``loss.backward()`` and
``optimizer.apply(grads, variables)``: with the driver's exchange active for
the model's optimizer (``exchange.active``), the wrapped ``apply`` hands the
gradients (numpy views of the torch tensors, no copy) to the exchange and
applies what comes back, so a user's own ``train_step`` is split too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

from daskdist.plugins.keras3 import exchange as exchange_module

if TYPE_CHECKING:
    from daskdist.strategy.drivers.contract import GradientExchange

__all__ = ["TorchSteps", "from_numpy", "limit_threads", "no_grad", "steps", "to_batch", "to_numpy", "views"]


def to_batch(batch: Any) -> Any:
    """A batch of numpy arrays as torch tensors (CPU: views, no copy), the structure kept."""
    import torch

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(leaf))
        return leaf

    if isinstance(batch, list):
        batch = tuple(batch)
    return optree.tree_map(convert, batch, none_is_leaf=True)


def to_numpy(grads: Sequence[Any], variables: Sequence[Any]) -> list[np.ndarray]:
    """The gradients as numpy views (zeros for a variable without a gradient)."""
    import torch

    arrays = []
    for grad, variable in zip(grads, variables):
        if grad is None:
            grad = torch.zeros(tuple(variable.shape), dtype=variable.value.dtype)
        arrays.append(grad.detach().contiguous().cpu().numpy())
    return arrays


def from_numpy(arrays: Sequence[Any]) -> list[Any]:
    """Reduced gradients (numpy) as torch tensors viewing them."""
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def views(variables: Sequence[Any]) -> list[Any]:
    """The variables' values without autograd and without a copy (numpy views them through DLPack)."""
    return [v.value.detach() for v in variables]


def no_grad() -> contextlib.AbstractContextManager[Any]:
    """Where weights are assigned outside autograd."""
    import torch

    guard: contextlib.AbstractContextManager[Any] = torch.no_grad()
    return guard


def limit_threads(threads: int) -> None:
    """torch's intra-op threads of this process."""
    import torch

    torch.set_num_threads(max(1, threads))


class TorchSteps:
    """A model's training and evaluation steps on the torch backend (Keras' own ``train_step``/``test_step``)."""

    def __init__(self, model: Any):
        self.model = model

    def parameters(self) -> list[Any]:
        return views(self.model.trainable_variables)

    def train_step(self, batch: Any, exchange: GradientExchange, rows: int) -> None:
        with exchange_module.active(self.model.optimizer, exchange, rows):
            self.model.train_step(to_batch(batch))

    def apply(self, gradients: Sequence[np.ndarray]) -> None:
        """Apply reduced gradients with the model's optimizer (a step this replica joined without data)."""
        import torch

        with torch.no_grad():
            self.model.optimizer.apply(from_numpy(gradients), list(self.model.trainable_variables))

    def test_step(self, batch: Any) -> None:
        import torch

        with torch.no_grad():
            self.model.test_step(to_batch(batch))


def steps(model: Any) -> TorchSteps:
    return TorchSteps(model)
