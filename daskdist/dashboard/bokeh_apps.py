"""Serving more Bokeh documents on a Dask dashboard that is already running.

Distributed builds its dashboard's Bokeh server (a ``BokehTornado``) once, from
``distributed.dashboard.scheduler.applications``, when the scheduler starts;
a preload can add documents to that dict before. Afterwards there is no
public way to add one: a second ``BokehTornado`` added to the scheduler's
``http_application`` serves its pages, but ``/individual-plots.json`` (the
list dask-labextension offers) only reads the first one's paths.

``add_documents`` therefore builds the new documents' Bokeh application as
distributed would (``BokehApplication``: same prefix, settings and template
variables) and moves its application contexts and routes into the running
dashboard's own ``BokehTornado``, so they are served, cleaned up and listed
as if they had been there from the start. Should that fail (a Bokeh whose
internals differ), the application is added beside it instead: pages served,
not listed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["add_documents", "bokeh_apps"]

logger = logging.getLogger(__name__)


def bokeh_apps(scheduler: Scheduler) -> list[Any]:
    """The ``BokehTornado`` applications of ``scheduler``'s dashboard (the first is distributed's)."""
    from bokeh.server.tornado import BokehTornado

    application = getattr(scheduler, "http_application", None)
    return [a for a in getattr(application, "applications", []) if isinstance(a, BokehTornado)]


def _routes(app: Any, paths: list[str]) -> list[Any]:
    """``app``'s routing rules that belong to the documents at ``paths`` (page, websocket, static...)."""
    from tornado.routing import PathMatches

    starts = [app.prefix + path + "/" for path in paths]
    rules = [r for r in app.wildcard_router.rules
             if isinstance(r.matcher, PathMatches) and r.matcher.regex.pattern.startswith(tuple(starts))]
    missing = [p for p, s in zip(paths, starts) if not any(r.matcher.regex.pattern.startswith(s) for r in rules)]
    if missing:
        raise RuntimeError(f"no routes found for {missing}")
    return rules


def _adopt(primary: Any, app: Any) -> None:
    """Move ``app``'s documents (contexts and routes) into the running ``primary``."""
    contexts = dict(app.applications)
    rules = _routes(app, list(contexts))
    loop = primary._loop
    primary.add_handlers(r".*$", rules)
    for context in contexts.values():
        context._loop = loop
    primary._applications.update(contexts)
    for context in contexts.values():
        loop.add_callback(context.run_load_hook)


def add_documents(scheduler: Scheduler, docs: dict[str, Callable[..., None]]) -> bool:
    """Serve ``docs`` (path -> document function ``(scheduler, extra, doc)``) on the running dashboard.

    Returns False when the scheduler has no Bokeh dashboard. Must run on the
    scheduler's event loop.
    """
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables
    from tornado.ioloop import IOLoop

    apps = bokeh_apps(scheduler)
    if not apps:
        return False
    primary = apps[0]
    app = BokehApplication(docs, scheduler, prefix=primary.prefix, template_variables=template_variables(scheduler))  # type: ignore[no-untyped-call]
    try:
        _adopt(primary, app)
    except (AttributeError, KeyError, TypeError, RuntimeError) as e:  # Bokeh internals differ: serve them apart
        logger.debug("Could not add %s to the dashboard's Bokeh server (%s); serving them beside it",
                     sorted(docs), e)
        scheduler.http_application.add_application(app)
        app.initialize(IOLoop.current())
        app.start()
    return True
