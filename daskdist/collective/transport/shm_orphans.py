"""Shared-memory segments left behind when every replica of a host died at once.

Surviving replicas unlink the segments of a crashed peer (``shm.py``), but
when all of a host's replicas are killed together (the whole cluster
SIGKILLed, the OOM killer taking the nanny and its workers) nobody is left
to do it, and each channel keeps a few MiB of ``/dev/shm`` (memory) until
the machine reboots. So every segment records who made it: the creator's
process id and its pid namespace, in the segment's control block. When a
replica creates its channels it removes the daskdist segments whose creator
is gone. A segment is only removed when its creator shares this process's
pid namespace (so a process id can be checked at all) and that process no
longer exists; segments of other containers, of live groups and of older
daskdist versions (no owner recorded) are left alone.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any

__all__ = ["OWNER_OFFSET", "owner_stamp", "sweep_orphans"]

logger = logging.getLogger(__name__)

#: Where the owner is recorded in a segment: in the control block, after the write counter's 8 bytes.
OWNER_OFFSET = 16
_OWNER = struct.Struct("<8sqq")  # magic, creator pid, creator's pid namespace inode
_MAGIC = b"ddowner1"
_SHM_DIR = "/dev/shm"
_PREFIX = "daskdist-"


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover - not Linux, or /proc not mounted
        return 0


def owner_stamp() -> bytes:
    """The bytes to write at ``OWNER_OFFSET`` of a segment this process creates."""
    return _OWNER.pack(_MAGIC, os.getpid(), _pid_namespace())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _owner(path: str) -> tuple[int, int] | None:
    """``(pid, pid namespace)`` recorded in the segment at ``path``, or ``None`` if it records none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, _OWNER.size, OWNER_OFFSET)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < _OWNER.size:
        return None
    magic, pid, namespace = _OWNER.unpack(raw)
    if magic != _MAGIC or pid <= 0:
        return None
    return pid, namespace


def sweep_orphans(directory: str = _SHM_DIR, unlink: Any = None) -> list[str]:
    """Remove the daskdist segments under ``directory`` whose creator no longer exists; their names back.

    ``unlink`` removes one segment by name (default: ``os.unlink`` of the
    file). Never raises: a segment that cannot be read or removed is skipped.
    """
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_PREFIX)]
    except OSError:
        return []
    here = _pid_namespace()
    removed = []
    for name in names:
        owner = _owner(os.path.join(directory, name))
        if owner is None:
            continue
        pid, namespace = owner
        if namespace != here or not here or _alive(pid):
            continue
        try:
            if unlink is None:
                os.unlink(os.path.join(directory, name))
            else:
                unlink(name)
        except OSError as e:
            logger.debug("Could not remove orphaned segment %s: %s", name, e)
            continue
        removed.append(name)
    if removed:
        logger.info("Removed %d shared-memory segment(s) left by replicas that no longer exist: %s",
                    len(removed), ", ".join(sorted(removed)))
    return removed
