"""glibc's allocator settings for replica processes: a training step's memory stays mapped between steps.

A replica runs in a worker thread, so glibc serves its allocations from a
*thread arena* made of 64 MiB heaps, and its thresholds adapt to what the
process allocated before. Training steps allocate their activations and
gradients afresh every step and free them at its end; with the defaults that
memory was often handed back to the OS at the end of a step and page-faulted
in again in the next (measured: 1,000-10,000 minor faults and 4-12 ms of
system time per 25-30 ms step of a small CNN, where a standalone process had
about none). ``tune_for_replicas`` fixes the thresholds once per worker
process when its first replica starts (``daskdist.replica.malloc``, read on
the client).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading
from typing import Any

__all__ = ["HEAP_BYTES", "MMAP_THRESHOLD_MAX", "set_malloc_options", "tune_for_replicas"]

logger = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameters.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
#: On 64-bit glibc: the ceiling of the adaptive mmap threshold (``DEFAULT_MMAP_THRESHOLD_MAX``) and the size
#: of a thread arena's heap (``HEAP_MAX_SIZE``, twice that).
MMAP_THRESHOLD_MAX = 32 << 20
HEAP_BYTES = 64 << 20

def set_malloc_options(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = HEAP_BYTES,
                       top_pad: int = HEAP_BYTES) -> bool:
    """Make glibc keep a training step's memory from one step to the next (``mallopt``, whole process).

    PyTorch allocates a CPU step's activations and gradients afresh every
    step and frees them at its end. In a replica thread (a glibc *thread
    arena*, made of 64 MiB heaps) that memory was often handed back to the OS
    at the end of each step and page-faulted in again in the next: when a
    step's peak overflows into a second heap, freeing it empties that heap,
    which glibc unmaps; and until the process has freed one block as large as
    the step's largest, glibc's adaptive thresholds map big blocks on their
    own and trim the heap top. Measured in ``benchmarks/training.py --parts 3``:
    1,000 to 3,500 minor page faults and 4 to 12 ms of system time per 25-30 ms
    step of a small CNN, where a DDP rank (main thread, main arena) had about
    none. The
    defaults fix the thresholds at the values glibc's adaptation ends at and
    keep up to a heap's worth of free memory per arena: blocks of
    ``mmap_threshold`` bytes or more are still mapped on their own and
    returned to the OS when freed.

    Parameters
    ----------
    mmap_threshold
        Allocations of at least this many bytes get their own mapping (at most 32 MiB).
    trim_threshold
        Free memory at the top of a heap beyond this many bytes is returned to the OS.
    top_pad
        Bytes of free memory an arena keeps when it trims, and the margin that keeps an emptied
        thread-arena heap from being unmapped (a heap's size keeps every one).

    Returns
    -------
    bool
        Whether every option was set: ``False`` off glibc, or where glibc refused a value.

    Raises
    ------
    ValueError
        A value that is not a non-negative C ``int``.
    """
    options = ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad))
    for _, value in options:
        if not 0 <= int(value) < 2**31:
            raise ValueError(f"malloc options are non-negative C ints (bytes), got {value!r}")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        results = [libc.mallopt(option, int(value)) for option, value in options]
    except (OSError, AttributeError) as e:  # pragma: no cover - an unusual libc
        logger.debug("Could not set glibc's malloc options: %s", e)
        return False
    return all(r == 1 for r in results)


_lock = threading.Lock()
_tuned = False


def tune_for_replicas(setting: Any) -> bool:
    """Apply ``setting`` (``daskdist.replica.malloc``) once per process; later calls do nothing.

    ``"auto"`` or ``True``: ``set_malloc_options()``'s defaults; a mapping:
    its arguments (``mmap-threshold``, ``trim-threshold``, ``top-pad``);
    ``False``/``None``: leave the allocator alone. Returns whether options were set by this call.
    """
    global _tuned
    if setting in (False, None, "false", "off"):
        return False
    with _lock:
        if _tuned:
            return False
        _tuned = True
    kwargs = {str(k).replace("-", "_"): v for k, v in setting.items()} if isinstance(setting, dict) else {}
    ok = set_malloc_options(**kwargs)
    logger.debug("glibc malloc options for replica steps (%s): %s", setting, "set" if ok else "not set")
    return ok
