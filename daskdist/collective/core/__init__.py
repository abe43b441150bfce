"""The collective core under the process group: the communicator, its calls and what they share.

``communicator`` runs one collective at a time as a ``call.CollectiveCall``
over a transport (``collective.transport``), choosing an all-reduce engine
(``collective.engines``) for each plan; ``collectives`` holds the other
collectives (all-gather, reduce-scatter, broadcast, barrier); ``algorithms``
the generic ring/direct algorithms every engine falls back to; ``mailbox`` the
tagged inbox every transport delivers to; ``packing``, ``buffers`` and
``reduction`` the pack/unpack, buffer pool and dtype rules; ``stall`` the
stall reports; ``settings`` the collective settings read from ``dask.config``.
Users reach all of this through ``collective.process_group`` (the face).
"""

from __future__ import annotations

__all__: list[str] = []
