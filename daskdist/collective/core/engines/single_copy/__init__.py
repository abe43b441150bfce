"""The single-copy engine: replicas on one host read each other's packs in place.

``all_reduce`` holds ``SingleCopyAllReduce`` (the cross-memory probe, chunked
reads, scratch buffers); ``engine`` is the pack engine the packed path picks
for large numpy packs when every peer shares the host.
"""

from __future__ import annotations

__all__: list[str] = []
