"""Observability on the scheduler: the step-metrics store, Prometheus metrics, the Bokeh page, timelines.

``store``: what the scheduler keeps of each group's step timings and fit progress
(fed by the scheduler plugin's ``log_event`` hook). ``membership``: each group's
generations (members before and after, why) for the page's markers and replica
count. ``stragglers``: which replica
the others waited for in each collective. ``event_log``: bounding the scheduler's
own copy of the step events. ``prometheus``: a collector on the scheduler's
``/metrics`` endpoint. ``page``: the ``/daskdist`` page of the Dask dashboard;
``bokeh_apps``: serving it on a dashboard that is already running.
``timeline``: Chrome traces of the replicas' steps.
"""
