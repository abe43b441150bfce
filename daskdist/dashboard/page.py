"""The ``/daskdist`` page of the Dask dashboard: step phases, throughput and stragglers.

``daskdist_doc`` is a Bokeh document function with distributed's signature
``(scheduler, extra, doc)``. ``install(scheduler)`` adds the pages to a running
scheduler's dashboard (the strategy's plugin calls it, so embedded clusters and
clusters the strategy attaches to both get them; ``bokeh_apps.add_documents``
puts them in the dashboard's own Bokeh server, so ``individual-daskdist-steps``
is listed in ``individual-plots.json`` for dask-labextension too);
``dashboards/daskdist_preload.py`` adds them before the dashboard starts instead.

The page shows the group that reported most recently: per replica and step the
stacked phases of the last ``daskdist.metrics.dashboard-steps`` steps;
throughput in steps/s and samples/s (summed over the replicas; only for steps
that know their batch size); the latest ``fit`` progress; and the stragglers of
those steps' collectives (``stragglers.StragglerTracker``): per collective the
replica the others waited for and how long, and per replica how often.
Membership changes (a worker lost, one admitted: ``membership.py``) are a
dashed vertical line on the step chart, before the first step of the new
generation, labelled with the generation, the replica count and the workers
lost and admitted; the replica count over time is a chart of its own.
"""

from __future__ import annotations

import html
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from daskdist import config
from daskdist.dashboard.membership import marker_positions

if TYPE_CHECKING:
    from distributed import Scheduler

    from daskdist.dashboard.store import GroupMetrics, MetricsStore

__all__ = ["DOCS", "PAGE", "DaskdistPage", "StepPhases", "Stragglers", "daskdist_doc", "individual_steps_doc",
           "install", "time_unit"]

logger = logging.getLogger(__name__)

PAGE = "/daskdist"
INDIVIDUAL = "/individual-daskdist-steps"
STACKED = ("input_wait", "compute", "allreduce", "apply")
COLORS = ("#f28e2b", "#4e79a7", "#e15759", "#59a14f")
UPDATE_MS = 500
MARKER_COLOR = "#222222"
#: Columns of the step chart's membership markers (``x``: where on the step axis; ``time``: ms since the epoch).
MARKER_COLUMNS = ("x", "generation", "replicas", "label", "lost", "admitted", "reason", "time")
#: Columns of the replica count over time (``membership.MembershipHistory.series``).
COUNT_COLUMNS = ("time", "replicas", "generation", "lost", "admitted", "reason")
COLLECTIVE_ROWS = 200  # collectives listed at most (newest first)
NO_LIVE_GROUP = ("No live daskdist group: every strategy that reported steps is closed "
                 "(set daskdist.metrics.dashboard-closed-groups to show the last closed one).")


def _store(scheduler: Scheduler) -> MetricsStore | None:
    plugin = scheduler.extensions.get("daskdist")
    return getattr(plugin, "store", None)


def _show_closed() -> bool:
    """Whether the page may show a closed group (``daskdist.metrics.dashboard-closed-groups``)."""
    return bool(config.get("metrics.dashboard-closed-groups", False))


def _latest_group(scheduler: Scheduler) -> GroupMetrics | None:
    store = _store(scheduler)
    return store.latest_group(include_closed=_show_closed()) if store is not None else None


def _steps_shown() -> int:
    return int(config.get("metrics.dashboard-steps", 50))


#: Units a time axis may read in: (name, factor from seconds, smallest value in seconds it is used for).
TIME_UNITS = (("s", 1.0, 1.0), ("ms", 1e3, 1e-3), ("µs", 1e6, 0.0))

# A hovered duration, in the unit that suits that value (3 decimals).
_HOVER_DURATION = """
const a = Math.abs(value);
if (a >= 1) { return value.toFixed(3) + " s"; }
if (a >= 1e-3) { return (value * 1e3).toFixed(3) + " ms"; }
return (value * 1e6).toFixed(1) + " µs";
"""
# A tick of an axis whose data are seconds, shown in the axis's unit (``scale``) without exponent.
_TICK_IN_UNIT = "return Number((tick * scale).toPrecision(4)).toString();"


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit a person reads durations up to ``seconds`` in (s, ms or µs) and its factor from seconds."""
    for name, factor, smallest in TIME_UNITS:
        if abs(seconds) >= smallest:
            return name, factor
    return TIME_UNITS[-1][0], TIME_UNITS[-1][1]  # pragma: no cover - the last unit starts at 0


def _time_formatter(factor: float) -> Any:
    from bokeh.models import CustomJSTickFormatter

    return CustomJSTickFormatter(args={"scale": factor}, code=_TICK_IN_UNIT)


class StepPhases:
    """Stacked phase bars per replica per step, a throughput plot and a summary of one group.

    Shows the group that reported most recently; ``update`` refreshes from the store.
    """

    def __init__(self, scheduler: Scheduler, sizing_mode: str = "stretch_width", **kwargs: Any):
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, CustomJSHover, DataRange1d, Div, HoverTool, LabelSet, LinearAxis
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.steps = _steps_shown()
        self.source = ColumnDataSource({k: [] for k in ("x", "replica", "run_id", "total", "samples", *STACKED)},
                                       name="daskdist-steps")
        self.rate = ColumnDataSource({"time": [], "steps_per_second": [], "samples_per_second": []},
                                     name="daskdist-throughput")
        self.phases = figure(title="Step phases per replica (last steps)", height=320, sizing_mode=sizing_mode,
                             x_axis_label="step (bars: replicas in rank order)", y_axis_label="time per step (ms)",
                             tools="xpan,xwheel_zoom,reset", **kwargs)
        self.unit = "ms"  # of the time axis; follows the longest step shown (``update``)
        self.phases.yaxis[0].formatter = _time_formatter(1e3)
        renderers = self.phases.vbar_stack(list(STACKED), x="x", width=0.8, source=self.source, color=list(COLORS),
                                           legend_label=["input wait", "compute", "all-reduce", "apply"])
        self.phases.legend.location = "top_left"
        self.phases.legend.orientation = "horizontal"
        duration = CustomJSHover(code=_HOVER_DURATION)
        timed = ("total", *STACKED)
        self.phases.add_tools(HoverTool(renderers=renderers, formatters={f"@{k}": duration for k in timed}, tooltips=[
            ("replica", "@replica"), ("run", "@run_id"), ("samples", "@samples"), ("total", "@total{custom}"),
            ("input wait", "@input_wait{custom}"), ("compute", "@compute{custom}"),
            ("all-reduce", "@allreduce{custom}"), ("apply", "@apply{custom}"),
        ]))
        self.throughput = figure(title="Throughput: steps/s (left), samples/s (right)", height=200,
                                 sizing_mode=sizing_mode, x_axis_type="datetime", tools="", y_axis_label="steps/s",
                                 **kwargs)
        steps_line = self.throughput.line(x="time", y="steps_per_second", source=self.rate, color=COLORS[1],
                                          legend_label="steps/s")
        self.throughput.extra_y_ranges = {"samples": DataRange1d()}
        samples_line = self.throughput.line(x="time", y="samples_per_second", source=self.rate, color=COLORS[3],
                                            y_range_name="samples", legend_label="samples/s", line_width=2,
                                            line_dash="dashed")
        self.throughput.y_range.renderers = [steps_line]
        self.throughput.extra_y_ranges["samples"].renderers = [samples_line]
        self.throughput.add_layout(LinearAxis(y_range_name="samples", axis_label="samples/s"), "right")
        self.throughput.legend.location = "top_left"
        self.summary = Div(text="No daskdist steps reported yet.", name="daskdist-summary")
        # membership changes: a marker per change on the step chart, and the replica count over time
        self.markers = ColumnDataSource({k: [] for k in MARKER_COLUMNS}, name="daskdist-membership")
        self.phases.vspan(x="x", source=self.markers, line_color=MARKER_COLOR, line_width=2, line_dash="dashed")
        self.phases.add_layout(LabelSet(x="x", y=6, y_units="screen", text="label", source=self.markers,
                                        angle=math.pi / 2, x_offset=-4, text_font_size="9px",
                                        text_color=MARKER_COLOR, background_fill_color="white",
                                        background_fill_alpha=0.85))
        self.replica_count = ColumnDataSource({k: [] for k in COUNT_COLUMNS}, name="daskdist-replicas")
        self.replicas = figure(title="Replicas over time (a point per membership generation)", height=160,
                               sizing_mode=sizing_mode, x_axis_type="datetime", tools="", y_axis_label="replicas",
                               **kwargs)
        self.replicas.step(x="time", y="replicas", source=self.replica_count, mode="after", color=COLORS[1],
                           line_width=2)
        points = self.replicas.scatter(x="time", y="replicas", source=self.replica_count, size=7,
                                       color=MARKER_COLOR)
        self.replicas.add_tools(HoverTool(renderers=[points], tooltips=[
            ("generation", "@generation"), ("replicas", "@replicas"), ("lost", "@lost"), ("admitted", "@admitted"),
            ("reason", "@reason")]))
        self.replicas.y_range.start = 0
        self.root = column(self.summary, self.phases, self.throughput, self.replicas, sizing_mode=sizing_mode)
        self._group: str | None = None

    def data(self) -> tuple[dict[str, list[Any]], str, float, float | None]:
        """Bar data of the latest group, its summary (HTML), its steps/s and samples/s (None: unknown)."""
        data: dict[str, list[Any]] = {k: [] for k in self.source.data}
        store = _store(self.scheduler)
        group = store.latest_group(include_closed=_show_closed()) if store is not None else None
        if group is None or store is None:
            closed = store is not None and any(g.closed for g in list(store.groups.values()))
            return data, NO_LIVE_GROUP if closed else "No daskdist steps reported yet.", 0.0, None
        per_replica = group.steps(self.steps)
        n = max(len(per_replica), 1)
        width = 1.0 / (n + 1)
        for slot, (rank, steps) in enumerate(per_replica.items()):
            for index, step in enumerate(steps):
                data["x"].append(index + (slot + 0.5) * width)
                data["replica"].append(rank)
                data["run_id"].append(step.get("run_id", -1))
                data["total"].append(step.get("total", 0.0))
                samples = step.get("samples")
                data["samples"].append("?" if samples is None else str(samples))
                for phase in STACKED:
                    data[phase].append(step.get(phase, 0.0))
        rate = group.throughput()
        samples_rate = group.samples_per_second()
        total_steps = sum(r.steps_total for r in group.replicas.values()) // n
        samples_text = "samples/s unknown" if samples_rate is None else f"{samples_rate:,.0f} samples/s"
        text = (f"<b>Group</b> {html.escape(group.group)}{' (closed)' if group.closed else ''}: "
                f"{len(per_replica)} replicas, {total_steps} steps, <b>{rate:.2f} steps/s</b>, "
                f"<b>{samples_text}</b>")
        changes = group.membership.changes_after_start()
        if changes:
            lost = sum(len(c.lost) for c in changes)
            left = sum(len(c.left) for c in changes)
            admitted = sum(len(c.admitted) for c in changes)
            text += (f"<br><b>membership</b> generation {changes[-1].generation}: {lost} worker(s) lost, {left} retired, "
                     f"{admitted} admitted since the start; last change: {html.escape(changes[-1].reason)}")
        progress = store.latest_progress()
        if progress is not None:
            logs = ", ".join(f"{k}={v:.4g}" if isinstance(v, (int, float)) else f"{k}={v}"
                             for k, v in progress["logs"].items())
            fit_step = "end" if progress["step"] == -1 else progress["step"]
            text += f"<br><b>fit</b> epoch {progress['epoch']}, step {fit_step}: {html.escape(logs)}"
        return data, text, rate, samples_rate

    def membership_data(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The step chart's markers (one per membership change in view) and the replica count over time."""
        markers: dict[str, list[Any]] = {k: [] for k in MARKER_COLUMNS}
        group = _latest_group(self.scheduler)
        if group is None:
            return markers, {k: [] for k in COUNT_COLUMNS}
        steps = group.steps(self.steps)
        starts = [step["start"] for step in next(iter(steps.values()), [])]  # rank 0's: the oldest survivor
        for x, change in marker_positions(starts, group.membership.changes_after_start()):
            markers["x"].append(x)
            markers["generation"].append(change.generation)
            markers["replicas"].append(change.replicas)
            markers["label"].append(change.label())
            markers["lost"].append(", ".join(change.lost + [f"{a} (retired)" for a in change.left]))
            markers["admitted"].append(", ".join(change.admitted))
            markers["reason"].append(change.reason)
            markers["time"].append(change.time * 1000)
        return markers, group.membership.series()

    def _follow_time_unit(self, totals: list[float]) -> None:
        """Read the time axis in the unit of the longest step shown (1.5 ms, not 1.500e-3 s)."""
        unit, factor = time_unit(max(totals, default=1e-3))
        if unit != self.unit:
            self.unit = unit
            self.phases.yaxis[0].formatter = _time_formatter(factor)
            self.phases.yaxis[0].axis_label = f"time per step ({unit})"

    def update(self) -> None:
        data, text, rate, samples_rate = self.data()
        self._follow_time_unit(data["total"])
        self.source.data = data
        self.summary.text = text
        markers, count = self.membership_data()
        if markers != self.markers.data:
            self.markers.data = markers
        self.replica_count.data = count
        group = _latest_group(self.scheduler)
        if group is not None:
            if group.group != self._group:
                self._group = group.group
                self.rate.data = {"time": [], "steps_per_second": [], "samples_per_second": []}
            self.rate.stream({"time": [time.time() * 1000], "steps_per_second": [rate],
                              "samples_per_second": [math.nan if samples_rate is None else samples_rate]},
                             rollover=600)


def _set_table_data(source: Any, data: dict[str, list[Any]]) -> None:
    """Replace the data of a ``DataTable``'s source so that the browser redraws the table.

    BokehJS redraws a ``DataTable`` when its view's row indices change, which
    new data with as many rows as the old does not do: the table would keep
    showing the old rows. Emptying the source first makes the indices change.
    """
    if source.data == data:
        return
    old_rows = len(next(iter(source.data.values()), []))
    if old_rows and old_rows == len(next(iter(data.values()), [])):
        source.data = {k: [] for k in data}
    source.data = data


class Stragglers:
    """Who the others waited for in the collectives of the last steps: per replica and per collective."""

    def __init__(self, scheduler: Scheduler, sizing_mode: str = "stretch_width"):
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, DataTable, Div, NumberFormatter, TableColumn

        self.scheduler = scheduler
        self.steps = _steps_shown()
        self.min_wait = config.get_seconds("metrics.straggler-min-wait")
        self.summary = ColumnDataSource({k: [] for k in ("replica", "count", "share", "mean_wait_ms", "wait_ms")},
                                        name="daskdist-stragglers")
        self.collectives = ColumnDataSource({k: [] for k in ("run_id", "seq", "kind", "replica", "wait_ms")},
                                            name="daskdist-collectives")
        ms = NumberFormatter(format="0.000")
        self.title = Div(text=f"<b>Stragglers (last {self.steps} steps)</b>: no collectives yet.",
                         name="daskdist-stragglers-title")
        summary_table = DataTable(source=self.summary, height=160, index_position=None, sizing_mode=sizing_mode,
                                  columns=[TableColumn(field="replica", title="replica waited for"),
                                           TableColumn(field="count", title="collectives"),
                                           TableColumn(field="share", title="share", formatter=NumberFormatter(
                                               format="0.0%")),
                                           TableColumn(field="mean_wait_ms", title="mean wait (ms)", formatter=ms),
                                           TableColumn(field="wait_ms", title="total wait (ms)", formatter=ms)])
        collective_table = DataTable(source=self.collectives, height=160, index_position=None,
                                     sizing_mode=sizing_mode,
                                     columns=[TableColumn(field="run_id", title="run"),
                                              TableColumn(field="seq", title="collective #"),
                                              TableColumn(field="kind", title="kind"),
                                              TableColumn(field="replica", title="waited for"),
                                              TableColumn(field="wait_ms", title="others waited (ms)",
                                                          formatter=ms)])
        self.root = column(self.title, row(summary_table, collective_table, sizing_mode=sizing_mode),
                           sizing_mode=sizing_mode)

    def data(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]], str]:
        """The per-replica summary, the per-collective rows (newest first) and the title (HTML)."""
        summary: dict[str, list[Any]] = {k: [] for k in self.summary.data}
        rows: dict[str, list[Any]] = {k: [] for k in self.collectives.data}
        group = _latest_group(self.scheduler)
        title = f"<b>Stragglers (last {self.steps} steps)</b>"
        if group is None or group.size < 2:
            return summary, rows, title + ": no collectives between replicas yet."
        collectives = group.recent_collectives(self.steps)
        totals = group.stragglers.summary(collectives)
        charged = sum(t.count for t in totals.values())
        for rank, t in totals.items():
            summary["replica"].append(rank)
            summary["count"].append(t.count)
            summary["share"].append(t.count / len(collectives))
            summary["mean_wait_ms"].append(t.mean_wait * 1e3)
            summary["wait_ms"].append(t.wait * 1e3)
        for c in reversed(collectives[-COLLECTIVE_ROWS:]):
            rows["run_id"].append(c["run_id"])
            rows["seq"].append(c["seq"])
            rows["kind"].append(c["kind"])
            rows["replica"].append(c["replica"])
            rows["wait_ms"].append(c["wait"] * 1e3)
        title += (f": {len(collectives)} collectives, {charged} in which the others waited at least "
                  f"{self.min_wait * 1e3:g} ms for one replica")
        return summary, rows, title

    def update(self) -> None:
        summary, rows, title = self.data()
        _set_table_data(self.summary, summary)
        _set_table_data(self.collectives, rows)
        self.title.text = title


class DaskdistPage:
    """The whole page: ``StepPhases`` above ``Stragglers``."""

    def __init__(self, scheduler: Scheduler):
        from bokeh.layouts import column

        self.phases = StepPhases(scheduler)
        self.stragglers = Stragglers(scheduler)
        self.root = column(self.phases.root, self.stragglers.root, sizing_mode="stretch_width")

    def update(self) -> None:
        self.phases.update()
        self.stragglers.update()


def _periodic(doc: Any, component: Any) -> None:
    from distributed.dashboard.components import add_periodic_callback

    component.update()
    add_periodic_callback(doc, component, UPDATE_MS)  # type: ignore[no-untyped-call]


def daskdist_doc(scheduler: Scheduler, extra: dict[str, Any], doc: Any) -> None:
    """The full ``/daskdist`` page, in the dashboard's template (menus included)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    component = DaskdistPage(scheduler)
    _periodic(doc, component)
    doc.title = "Dask: daskdist"
    doc.add_root(component.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def individual_steps_doc(scheduler: Scheduler, extra: dict[str, Any], doc: Any) -> None:
    """The phase bars alone (an individual plot, as dask-labextension embeds them)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME

    component = StepPhases(scheduler, sizing_mode="stretch_both")
    _periodic(doc, component)
    doc.add_root(component.phases)
    doc.title = "Dask: daskdist steps"
    doc.theme = BOKEH_THEME


DOCS = {PAGE: daskdist_doc, INDIVIDUAL: individual_steps_doc}


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
    from daskdist.dashboard.bokeh_apps import add_documents, bokeh_apps

    try:
        apps = bokeh_apps(scheduler)
        if not apps:
            return False
        if not any(PAGE in app.app_paths for app in apps):
            add_documents(scheduler, DOCS)
    except ImportError:  # no bokeh, or a bokeh that distributed refuses
        return False
    logger.debug("daskdist dashboard served at %s", PAGE)
    add_menu_entry(scheduler)
    return True
