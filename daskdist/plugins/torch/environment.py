"""torchrun's environment variables, made from a replica group's membership.

Libraries that train on ``torch.distributed`` read where they run from the
environment that ``torchrun`` leaves (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
...), not from the initialised group: Hugging Face's ``Trainer`` and
``accelerate`` take a process with no ``WORLD_SIZE`` for a single process and
train it alone on all the data. ``init_process_group()`` therefore exports
these variables for its group (``export``) and its destruction puts back what
was there before (``restore``).

A "node" of torchrun is a host here: ``LOCAL_RANK`` is a replica's position
among the members on its host, ``GROUP_RANK`` the host's position among the
group's hosts (in the order of their first member). daskdist's ranks need not
be contiguous per host, as torchrun's are.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from distributed.comm import get_address_host

__all__ = ["TORCHRUN_VARIABLES", "export", "restore", "torchrun_environment"]

logger = logging.getLogger(__name__)

#: what torchrun sets in each process it starts (``torch.distributed.run``), and ``restore`` puts back
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")

_saved: dict[str, str | None] | None = None


def torchrun_environment(rank: int, hosts: Sequence[str], addresses: Sequence[str]) -> dict[str, str]:
    """The variables torchrun would give the process of ``rank`` in a group placed on ``hosts``.

    Parameters
    ----------
    rank
        This replica's rank in the group.
    hosts
        Each member's host, in rank order (``Membership.hosts``).
    addresses
        Each member's worker address, in rank order: ``MASTER_ADDR`` is rank 0's
        host (accelerate insists on it when the group spans hosts). No
        ``MASTER_PORT``: the group met already and listens on no port of its own.

    Returns
    -------
    dict
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
        ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME`` and
        ``MASTER_ADDR``, as strings.
    """
    if not 0 <= rank < len(hosts) or len(hosts) != len(addresses):
        raise ValueError(f"rank {rank} is not one of the {len(hosts)} members (hosts {list(hosts)}, "
                         f"addresses {list(addresses)})")
    host_order = list(dict.fromkeys(hosts))
    mine = hosts[rank]
    local = [r for r, h in enumerate(hosts) if h == mine]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(hosts)),
        "LOCAL_RANK": str(local.index(rank)),
        "LOCAL_WORLD_SIZE": str(len(local)),
        "GROUP_RANK": str(host_order.index(mine)),
        "GROUP_WORLD_SIZE": str(len(host_order)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(len(hosts)),
        "ROLE_NAME": "default",
        "MASTER_ADDR": get_address_host(addresses[0]),
    }


def export(variables: Mapping[str, str]) -> None:
    """Set ``variables`` in ``os.environ``, keeping what the torchrun variables were (once) for ``restore``."""
    global _saved
    if _saved is None:
        _saved = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    os.environ.update(variables)
    logger.debug("torchrun environment: %s", dict(variables))


def restore() -> None:
    """Put back the torchrun variables as they were before the first ``export`` (nothing if none was made)."""
    global _saved
    saved, _saved = _saved, None
    if saved is None:
        return
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
