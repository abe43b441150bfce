"""The ``/daskdist`` page of the Dask dashboard: per-replica step phases and throughput.

``daskdist_doc`` is a Bokeh document function with distributed's signature
``(scheduler, extra, doc)``. ``install(scheduler)`` adds the page to a running
scheduler (the strategy's plugin calls it, so embedded clusters and clusters
the strategy attaches to both get it); ``dashboards/daskdist_preload.py`` adds
it before the dashboard starts instead, which also lists
``individual-daskdist-steps`` in ``individual-plots.json`` (dask-labextension).
"""

from __future__ import annotations

import html
import logging
import time
from typing import TYPE_CHECKING, Any

from daskdist import config

if TYPE_CHECKING:
    from distributed import Scheduler

    from daskdist.dashboard.store import MetricsStore

__all__ = ["DOCS", "PAGE", "StepPhases", "daskdist_doc", "individual_steps_doc", "install"]

logger = logging.getLogger(__name__)

PAGE = "/daskdist"
INDIVIDUAL = "/individual-daskdist-steps"
STACKED = ("input_wait", "compute", "allreduce", "apply")
COLORS = ("#f28e2b", "#4e79a7", "#e15759", "#59a14f")
UPDATE_MS = 500


def _store(scheduler: Scheduler) -> MetricsStore | None:
    plugin = scheduler.extensions.get("daskdist")
    return getattr(plugin, "store", None)


class StepPhases:
    """Stacked phase bars per replica per step, a throughput line and a summary of one group.

    Shows the group that reported most recently; ``update`` refreshes from the store.
    """

    def __init__(self, scheduler: Scheduler, sizing_mode: str = "stretch_width", **kwargs: Any):
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, Div, HoverTool
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.steps = int(config.get("metrics.dashboard-steps", 50))
        self.source = ColumnDataSource({k: [] for k in ("x", "replica", "run_id", "total", *STACKED)},
                                       name="daskdist-steps")
        self.rate = ColumnDataSource({"time": [], "steps_per_second": []}, name="daskdist-throughput")
        self.phases = figure(title="Step phases per replica (last steps)", height=320, sizing_mode=sizing_mode,
                             x_axis_label="step (bars: replicas in rank order)", y_axis_label="seconds",
                             tools="xpan,xwheel_zoom,reset", **kwargs)
        renderers = self.phases.vbar_stack(list(STACKED), x="x", width=0.8, source=self.source, color=list(COLORS),
                                           legend_label=["input wait", "compute", "all-reduce", "apply"])
        self.phases.legend.location = "top_left"
        self.phases.legend.orientation = "horizontal"
        self.phases.add_tools(HoverTool(renderers=renderers, tooltips=[
            ("replica", "@replica"), ("run", "@run_id"), ("total", "@total{0.000 a}s"),
            ("input wait", "@input_wait{0.000 a}s"), ("compute", "@compute{0.000 a}s"),
            ("all-reduce", "@allreduce{0.000 a}s"), ("apply", "@apply{0.000 a}s"),
        ]))
        self.throughput = figure(title="Throughput (steps/s)", height=200, sizing_mode=sizing_mode,
                                 x_axis_type="datetime", tools="", **kwargs)
        self.throughput.line(x="time", y="steps_per_second", source=self.rate)
        self.summary = Div(text="No daskdist steps reported yet.", name="daskdist-summary")
        self.root = column(self.summary, self.phases, self.throughput, sizing_mode=sizing_mode)
        self._group: str | None = None

    def data(self) -> tuple[dict[str, list], str, float]:
        """Bar data of the latest group, its summary (HTML) and its throughput."""
        data: dict[str, list] = {k: [] for k in self.source.data}
        store = _store(self.scheduler)
        group = store.latest_group() if store is not None else None
        if group is None:
            return data, "No daskdist steps reported yet.", 0.0
        per_replica = group.steps(self.steps)
        n = max(len(per_replica), 1)
        width = 1.0 / (n + 1)
        for slot, (rank, steps) in enumerate(per_replica.items()):
            for index, step in enumerate(steps):
                data["x"].append(index + (slot + 0.5) * width)
                data["replica"].append(rank)
                data["run_id"].append(step.get("run_id", -1))
                data["total"].append(step.get("total", 0.0))
                for phase in STACKED:
                    data[phase].append(step.get(phase, 0.0))
        rate = group.throughput()
        total_steps = sum(r.steps_total for r in group.replicas.values()) // n
        text = (f"<b>Group</b> {html.escape(group.group)}{' (closed)' if group.closed else ''}: "
                f"{len(per_replica)} replicas, {total_steps} steps, <b>{rate:.2f} steps/s</b>")
        progress = store.latest_progress()
        if progress is not None:
            logs = ", ".join(f"{k}={v:.4g}" if isinstance(v, (int, float)) else f"{k}={v}"
                             for k, v in progress["logs"].items())
            step = "end" if progress["step"] == -1 else progress["step"]
            text += f"<br><b>fit</b> epoch {progress['epoch']}, step {step}: {html.escape(logs)}"
        return data, text, rate

    def update(self) -> None:
        data, text, rate = self.data()
        self.source.data = data
        self.summary.text = text
        store = _store(self.scheduler)
        group = store.latest_group() if store is not None else None
        if group is not None:
            if group.group != self._group:
                self._group = group.group
                self.rate.data = {"time": [], "steps_per_second": []}
            self.rate.stream({"time": [time.time() * 1000], "steps_per_second": [rate]}, rollover=600)


def _periodic(doc: Any, component: StepPhases) -> None:
    from distributed.dashboard.components import add_periodic_callback

    component.update()
    add_periodic_callback(doc, component, UPDATE_MS)


def daskdist_doc(scheduler: Scheduler, extra: dict, doc: Any) -> None:
    """The full ``/daskdist`` page, in the dashboard's template (menus included)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    component = StepPhases(scheduler)
    _periodic(doc, component)
    doc.title = "Dask: daskdist"
    doc.add_root(component.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def individual_steps_doc(scheduler: Scheduler, extra: dict, doc: Any) -> None:
    """The phase bars alone (an individual plot, as dask-labextension embeds them)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME

    component = StepPhases(scheduler, sizing_mode="stretch_both")
    _periodic(doc, component)
    doc.add_root(component.phases)
    doc.title = "Dask: daskdist steps"
    doc.theme = BOKEH_THEME


DOCS = {PAGE: daskdist_doc, INDIVIDUAL: individual_steps_doc}


def _bokeh_apps(scheduler: Scheduler) -> list[Any]:
    from bokeh.server.tornado import BokehTornado

    application = getattr(scheduler, "http_application", None)
    return [a for a in getattr(application, "applications", []) if isinstance(a, BokehTornado)]


def add_menu_entry(scheduler: Scheduler) -> None:
    """List the page in the dashboard's "More" menu (pages rendered from now on)."""
    from distributed.dashboard.scheduler import template_variables

    plots = template_variables(scheduler)["plots"]
    if not any(p.get("url") == PAGE.strip("/") for p in plots):
        plots.append({"url": PAGE.strip("/"), "name": "Daskdist"})
        plots.sort(key=lambda p: p["name"])


def install(scheduler: Scheduler) -> bool:
    """Serve the daskdist pages on ``scheduler``'s running dashboard (idempotent).

    Returns False when the scheduler has no Bokeh dashboard. Must run on the
    scheduler's event loop.
    """
    try:
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop
    except ImportError:  # no bokeh, or a bokeh that distributed refuses
        return False
    apps = _bokeh_apps(scheduler)
    if not apps:
        return False
    if not any(PAGE in app.app_paths for app in apps):
        app = BokehApplication(DOCS, scheduler, prefix=apps[0].prefix,
                               template_variables=template_variables(scheduler))
        scheduler.http_application.add_application(app)
        app.initialize(IOLoop.current())
        app.start()
        logger.debug("daskdist dashboard installed at %s", PAGE)
    add_menu_entry(scheduler)
    return True
