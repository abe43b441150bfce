"""Plug-in points for training other frameworks' models with daskdist's collectives.

``dd.plugins.torch``: PyTorch modules (imports torch only when used).
``dd.plugins.keras3``: Keras 3 models under the strategies (imports keras only when the user does).
``dd.plugins.lightning``: ``DaskdistEnvironment``, a Lightning cluster environment (imports Lightning when used).
"""

from __future__ import annotations

from daskdist.plugins import keras3, lightning, torch

__all__ = ["keras3", "lightning", "torch"]
