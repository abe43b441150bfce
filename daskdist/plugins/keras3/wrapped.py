"""Whether Keras' classes are wrapped in this process, asked from below the module that wraps them.

``hooks.install`` wraps Keras' ``Model``, ``Optimizer`` and ``Metric``
methods; it sits on top of the adapter (it calls into ``fit``, the
metrics' references, ``exchange``). The modules below it that load a
model, an optimizer or a metric on a worker (commands, references,
``ps``, the metrics' copies) must make sure the wrapping is done there
first, without importing ``hooks``: they call ``ensure()``, and ``hooks``
registers its ``install`` here when it is imported (the package's
``__init__`` imports it, so every process that imports one of these
modules has it registered).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ensure", "set_installer"]

_installer: Callable[[], None] | None = None


def set_installer(install: Callable[[], None]) -> None:
    """Register the function that wraps Keras' classes (``hooks.install``; idempotent)."""
    global _installer
    _installer = install


def ensure() -> None:
    """Wrap Keras' classes in this process if they are not yet (``hooks.install``).

    Raises
    ------
    RuntimeError
        No installer is registered (``daskdist.plugins.keras3`` was not imported).
    """
    if _installer is None:
        raise RuntimeError("daskdist.plugins.keras3 is not imported in this process: its hooks are not registered")
    _installer()
