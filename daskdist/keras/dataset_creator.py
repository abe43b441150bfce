"""``DatasetCreator``, an input concept, lives in ``daskdist.data.dataset_creator``; this name stays for old imports."""

from __future__ import annotations

from daskdist.data.dataset_creator import DatasetCreator

__all__ = ["DatasetCreator"]
