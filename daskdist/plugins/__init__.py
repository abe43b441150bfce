"""Plug-in points for training other frameworks' models with daskdist's collectives.

``dd.plugins.torch``: PyTorch modules (imports torch only when used).
"""

from __future__ import annotations

from daskdist.plugins import torch

__all__ = ["torch"]
