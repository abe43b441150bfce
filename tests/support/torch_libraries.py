"""What the tests of libraries over torch.distributed share: the same replicas on gloo, met as torchrun does."""

from __future__ import annotations

import contextlib
import gc
import socket

import numpy as np

import daskdist as dd


@contextlib.contextmanager
def gloo_torchrun_environment():
    """torchrun's variables for this replica, with a real ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's free port).

    A library that finds them initialises gloo itself, as under torchrun. On the way out the gloo
    group (if one was made) is destroyed and the variables are put back.
    """
    import torch.distributed as dist

    from daskdist import context
    from daskdist.plugins.torch import environment

    ctx = dd.get_replica_context()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    port = int(ctx.broadcast(np.array([port]), root=0)[0])
    members = context.current_runtime().membership
    variables = environment.torchrun_environment(ctx.replica_id_in_sync_group, members.hosts, members.addresses)
    environment.export({**variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        yield
    finally:
        gc.collect()  # the DDP model goes before its gloo group (~ProcessGroupGloo joins threads holding the GIL)
        if dist.is_initialized():
            dist.destroy_process_group()
        environment.restore()


@contextlib.contextmanager
def library_settings(**variables: str):
    """One torch thread and ``variables`` in the environment while a library trains; both put back afterwards.

    The shared cluster's workers are left as they were found (later modules use them too).
    """
    import os

    import torch

    threads = torch.get_num_threads()
    saved = {name: os.environ.get(name) for name in variables}
    torch.set_num_threads(1)
    os.environ.update(variables)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
