"""What NCCL can do here and for a group: versions, dtypes, ops, and the group's one decision.

Pure functions of what each replica reports at the rendezvous
(``local_features``), so the decision (``group_features``) is the same on
every replica and is unit-tested without a GPU. The engine that uses them is
``daskdist.collective.nccl``.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from daskdist.ops import ReduceOp

__all__ = [
    "BFLOAT16_VERSION",
    "MIN_VERSION",
    "describe_nccl_error",
    "group_features",
    "local_features",
    "nccl_dtype_name",
    "nccl_op_name",
    "parse_setting",
]

logger = logging.getLogger(__name__)

#: ``ncclCommAbort`` and ``ncclCommGetAsyncError`` exist from NCCL 2.4 (``get_version()`` codes: 2.4.x -> 24xx,
#: from 2.9 on major * 10000 + minor * 100 + patch).
MIN_VERSION = 2400
#: ``ncclBfloat16`` exists from NCCL 2.10.
BFLOAT16_VERSION = 21000

#: ``ncclResult_t`` codes; cupy's ``NcclError`` only names 0-5 and fails with ``KeyError`` on the others.
_NCCL_RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                 4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError (a peer failed)",
                 7: "ncclInProgress"}

#: numpy dtype name -> the ``cupy.cuda.nccl`` constant of NCCL's type (reductions).
_DTYPES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "bool": "NCCL_UINT8",  # 0/1 bytes; the ops are remapped (_BOOL_OPS)
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}
_OPS = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.MEAN: "NCCL_SUM",  # then divided by the group size (reduction.finalize)
    ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.MIN: "NCCL_MIN",
}
_BOOL_OPS = {
    ReduceOp.SUM: "NCCL_MAX",  # logical or
    ReduceOp.PRODUCT: "NCCL_MIN",  # logical and
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.MIN: "NCCL_MIN",
}


def describe_nccl_error(error: BaseException) -> str:
    """A readable NCCL failure: cupy's ``NcclError`` carries ``status``; codes it cannot name raise ``KeyError``."""
    code = getattr(error, "status", None)
    if code is None and isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        code = error.args[0]
    if code in _NCCL_RESULTS:
        return f"{_NCCL_RESULTS[code]} ({type(error).__name__}: {error})"
    return f"{type(error).__name__}: {error}"


def parse_setting(value: Any) -> bool:
    """``daskdist.collective.nccl`` as a bool: ``auto`` (use NCCL where it works) or ``false``.

    Raises
    ------
    ValueError
        Any other value.
    """
    if value in (False, None) or (isinstance(value, str) and value.lower() in ("false", "off", "no")):
        return False
    if value is True or (isinstance(value, str) and value.lower() in ("auto", "true", "on", "yes")):
        return True
    raise ValueError(f"daskdist.collective.nccl must be 'auto' or false, got {value!r}")


def nccl_dtype_name(dtype: Any, bfloat16: bool = False) -> str | None:
    """The ``cupy.cuda.nccl`` type constant that reduces ``dtype``, or ``None`` (generic algorithms).

    ``bfloat16``: the whole group has ``NCCL_BFLOAT16`` (NCCL 2.10 and a cupy that names it).
    """
    name = getattr(dtype, "name", str(dtype))
    if name == "bfloat16":
        return "NCCL_BFLOAT16" if bfloat16 else None
    return _DTYPES.get(name)


def nccl_op_name(op: ReduceOp, dtype: Any) -> str:
    """The ``cupy.cuda.nccl`` reduction constant for ``op`` on ``dtype`` (``MEAN``: the sum)."""
    if getattr(dtype, "kind", "") == "b":
        if op is ReduceOp.MEAN:
            raise TypeError("ReduceOp.MEAN is not defined for bool arrays")
        return _BOOL_OPS[op]
    return _OPS[op]


# -- what the group can use ---------------------------------------------------------


def local_features(enabled: bool, on_gpu: bool) -> dict[str, Any] | None:
    """What this replica offers NCCL, for the rendezvous; ``None``: nothing (CPU group, no cupy, no NCCL).

    Runs in the replica thread. Imports cupy only for GPU groups with NCCL enabled.
    """
    if not (enabled and on_gpu):
        return None
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:  # cupy absent or broken: the generic transports carry the group
        logger.debug("NCCL is not usable here: %s", e)
        return None
    if not getattr(nccl, "available", False):
        return None
    try:
        version = int(nccl.get_version())
        device = cupy.cuda.runtime.getDevice()
        gpu = f"{socket.gethostname()}/{cupy.cuda.runtime.deviceGetPCIBusId(device)}"
    except Exception as e:
        logger.debug("NCCL is not usable here: %s", e)
        return None
    return {"version": version, "bfloat16": hasattr(nccl, "NCCL_BFLOAT16"), "gpu": gpu}


def group_features(features: dict[int, dict[str, Any] | None], size: int) -> tuple[bool, bool, str]:
    """Decide from every replica's ``local_features`` whether the group uses NCCL.

    Returns
    -------
    usable, bfloat16, reason
        ``reason`` says why not, when not usable.
    """
    missing = [r for r in range(size) if not features.get(r)]
    if missing:
        return False, False, f"replicas {missing} have no usable NCCL (cupy with NCCL on a GPU group)"
    reports = {r: report for r, report in features.items() if report}
    old = [r for r in range(size) if int(reports[r].get("version", 0)) < MIN_VERSION]
    if old:
        return False, False, f"replicas {old} have an NCCL older than 2.4 (no ncclCommAbort)"
    versions = sorted({int(reports[r]["version"]) for r in range(size)})
    if len(versions) > 1:
        return False, False, f"replicas run different NCCL versions {versions}; NCCL needs the same on every rank"
    gpus: dict[str, int] = {}
    for r in range(size):
        gpu = str(reports[r].get("gpu"))
        if gpu in gpus:
            return False, False, f"replicas {gpus[gpu]} and {r} share the GPU {gpu}; NCCL needs one GPU per rank"
        gpus[gpu] = r
    bfloat16 = all(bool(reports[r].get("bfloat16")) and int(reports[r]["version"]) >= BFLOAT16_VERSION
                   for r in range(size))
    return True, bfloat16, ""
