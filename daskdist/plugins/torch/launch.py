"""A torchrun script run as ``__main__`` inside a replica (the replica side of ``python -m daskdist.torchrun``).

``run_script`` gives the replica's process torchrun's environment and runs the
script's source there, as torchrun's child process would run it:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ... from the group's membership
  (``environment.torchrun_environment``), ``TORCHELASTIC_RUN_ID``,
  ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS``;
- an agent store as torchrun's agent hosts one: rank 0 serves a ``TCPStore``
  on a free port of its worker's host, ``MASTER_ADDR``/``MASTER_PORT`` name it
  and ``TORCHELASTIC_USE_AGENT_STORE=True`` makes ``init_process_group()``
  (``env://``, on any backend) join it instead of serving one;
- the ``daskdist`` backend registered and attached to the replica
  (``backend.attach``), so ``init_process_group("daskdist")`` works too;
- ``sys.argv`` = the script and its arguments; ``sys.stdout``/``sys.stderr``
  go line by line to the client as Dask events (topic ``output_topic(run)``)
  for the ranks asked, and the last lines are kept for the failure report.

The script's exit (``sys.exit(0)`` or the end) returns 0; a non-zero exit or
an exception raises ``ScriptFailed`` with the rank, the exit code and the
traceback, which fails the strategy's run. ``interrupt(run)`` raises
``KeyboardInterrupt`` in a running script's thread (the client's Ctrl-C).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import io
import logging
import os
import runpy
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from daskdist import context
from daskdist.exceptions import ScriptFailed

if TYPE_CHECKING:
    from daskdist.group.service import ReplicaService

__all__ = ["ScriptFailed", "interrupt", "output_topic", "run_script"]

logger = logging.getLogger(__name__)

_TAIL_LINES = 40
_running: dict[str, int] = {}  # run id -> the thread running its script in this process
_running_lock = threading.Lock()


def output_topic(run: str) -> str:
    """The Dask event topic that carries the output lines of ``run``."""
    return f"daskdist-torchrun-{run}"


class _Lines(io.TextIOBase):
    """A text stream that sends each complete line as an event (when ``forward``) and keeps the last ones."""

    def __init__(self, service: ReplicaService, topic: str, rank: int, stream: str, forward: bool):
        self._runtime, self._topic, self._rank, self._stream, self._forward = service, topic, rank, stream, forward
        self._partial = ""
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        if self._partial:
            line, self._partial = self._partial, ""
            self._emit(line)

    def _emit(self, line: str) -> None:
        self.tail.append(line)
        if self._forward:
            self._runtime.log_event(self._topic, {"rank": self._rank, "stream": self._stream, "text": line})


@contextlib.contextmanager
def _environment(variables: dict[str, str], argv: list[str], path_entry: str) -> Iterator[None]:
    """torchrun's variables, ``sys.argv`` and the script's directory on ``sys.path``; all put back afterwards."""
    from daskdist.plugins.torch import environment

    saved_argv, saved_path = sys.argv, list(sys.path)
    environment.export(variables)
    sys.argv = argv
    sys.path.insert(0, path_entry)
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        environment.restore()


def _agent_store(ctx: Any, rank: int, host: str, timeout: float) -> tuple[Any, int]:
    """Rank 0 serves torchrun's agent store on a free port of its host; every rank learns the port."""
    import datetime

    import numpy as np
    import torch.distributed as dist

    store = None
    port = 0
    if rank == 0:
        store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)
        port = int(store.port)
    port = int(ctx.broadcast(np.array([port], dtype=np.int64), root=0)[0])
    return store, port


def run_script(run: str, name: str, source: str, args: list[str], output_ranks: list[int] | None,
               restart_count: int = 0, max_restarts: int = 0) -> int:
    """Run a torchrun script's ``source`` as ``__main__`` in this replica; 0, or ``ScriptFailed``.

    Parameters
    ----------
    run
        The launch's id (its output topic, ``interrupt``'s key, ``TORCHELASTIC_RUN_ID``).
    name
        The script's path on the client (its ``sys.argv[0]`` and file name here).
    source
        The script's text.
    args
        Its arguments.
    output_ranks
        The ranks whose lines go to the client (``None``: every rank).
    restart_count, max_restarts
        ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS``.
    """
    from distributed.comm import get_address_host

    from daskdist import config
    from daskdist.plugins.torch import backend
    from daskdist.plugins.torch.environment import torchrun_environment

    runtime = context.current_runtime()
    ctx = context.get_replica_context()
    if runtime is None or ctx is None:
        raise RuntimeError("run_script runs inside a replica (python -m daskdist.torchrun)")
    rank, members = int(runtime.rank), runtime.membership
    timeout = config.get_seconds("collective.timeout")
    store, port = _agent_store(ctx, rank, get_address_host(runtime.worker.address), timeout)
    variables = {**torchrun_environment(rank, members.hosts, members.addresses), "MASTER_PORT": str(port),
                 "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": run,
                 "TORCHELASTIC_RESTART_COUNT": str(restart_count), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
                 "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    backend.attach(runtime)
    forward = output_ranks is None or rank in output_ranks
    topic = output_topic(run)
    out = _Lines(runtime, topic, rank, "stdout", forward)
    err = _Lines(runtime, topic, rank, "stderr", forward)
    folder = tempfile.mkdtemp(prefix="daskdist-torchrun-")
    path = os.path.join(folder, os.path.basename(name) or "script.py")
    with open(path, "w") as f:
        f.write(source)
    script_dir = os.path.dirname(os.path.abspath(name))
    code, report = 0, ""
    with _running_lock:
        _running[run] = threading.get_ident()
    try:
        with _environment(variables, [name, *args], script_dir if os.path.isdir(script_dir) else folder), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                code = _exit_code(e.code)
                if code and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:
                code = 1
                report = traceback.format_exc()
                print(report, end="", file=sys.stderr)
    finally:
        with _running_lock:
            _running.pop(run, None)
        out.flush()
        err.flush()
        runtime.log_event(topic, {"rank": rank, "done": True})
        if store is not None:
            del store
        with contextlib.suppress(OSError):
            os.remove(path)
            os.rmdir(folder)
    if code:
        raise ScriptFailed(rank, code, report or "\n".join(err.tail) or "\n".join(out.tail))
    return 0


def _exit_code(code: Any) -> int:
    """``sys.exit``'s argument as a process exit status (``None`` 0, an int itself, anything else 1)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def interrupt(run: str) -> bool:
    """Raise ``KeyboardInterrupt`` in this process's thread running ``run``'s script; whether one was running.

    Python delivers it at the thread's next bytecode: a script blocked inside
    a C call (a gloo collective waiting for a dead peer) stops only when that
    call returns; the launcher then restarts the worker.
    """
    with _running_lock:
        ident = _running.get(run)
    if ident is None:
        return False
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
    logger.info("torchrun script %s interrupted", run)
    return True
