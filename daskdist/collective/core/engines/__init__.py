"""All-reduce engines: each says whether it ``accepts`` a plan and ``run``\\s it (see ``engines.base``)."""

from __future__ import annotations

__all__: list[str] = []
