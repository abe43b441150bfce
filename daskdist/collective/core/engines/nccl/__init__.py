"""The NCCL engine for GPU (cupy) replica groups.

``support`` reads NCCL's features and names (no cupy needed), ``engine`` holds
the ``NcclEngine`` a group shares (communicator set-up, polled and abortable
collectives), ``all_reduce`` is the all-reduce engine the communicator's
chooser picks for plans whose leaves are all GPU arrays.
"""

from __future__ import annotations

__all__: list[str] = []
