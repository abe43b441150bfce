"""``dask worker --preload`` module of the test workers: import what every replica imports, at start-up.

A warm worker of the pool (``tests/support/processes.py``) pays these imports while the previous test
runs, not inside the next test's first step.
"""

from __future__ import annotations

import daskdist  # noqa: F401
import daskdist.keras  # noqa: F401


def dask_setup(worker) -> None:  # noqa: ARG001 (the preload hook distributed calls)
    """Nothing to set up: the imports above are the point."""
