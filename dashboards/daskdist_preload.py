"""Scheduler preload: the daskdist dashboard page and metrics from the scheduler's start.

Usage::

    dask scheduler --preload dashboards/daskdist_preload.py

Importing this module (distributed does so before the dashboard starts) adds
``/daskdist`` and ``/individual-daskdist-steps`` to the dashboard's own Bokeh
applications, so the latter is listed in ``individual-plots.json`` (the plots
dask-labextension offers). ``dask_setup`` then installs daskdist's scheduler
plugin, which collects the replicas' step metrics (also served on
``/metrics``), and lists the page in the dashboard's "More" menu. Without this
preload a strategy installs all of it when it first attaches to the cluster
(``individual-plots.json`` entry included), so the preload only makes the page
and metrics there before any strategy runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from daskdist.dashboard import page
from daskdist.group.scheduler_plugin import DaskdistSchedulerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger("daskdist.preload")

try:
    from distributed.dashboard import scheduler as _dashboard
except ImportError:  # no bokeh: metrics only
    _dashboard = None
else:
    _dashboard.applications.update(page.DOCS)


async def dask_setup(scheduler: Scheduler) -> None:
    """Install daskdist's scheduler plugin (idempotent) and the page's menu entry."""
    await scheduler.register_scheduler_plugin(DaskdistSchedulerPlugin(), name="daskdist", idempotent=True)
    if _dashboard is not None and getattr(scheduler, "http_application", None) is not None:
        page.add_menu_entry(scheduler)
    logger.info("daskdist metrics and dashboard page installed on %s", scheduler.address)
