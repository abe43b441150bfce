"""Observability on the scheduler: the step-metrics store, Prometheus metrics, the Bokeh page, timelines.

``store``: what the scheduler keeps of each group's step timings and fit progress
(fed by the scheduler plugin's ``log_event`` hook). ``prometheus``: a collector
on the scheduler's ``/metrics`` endpoint. ``bokeh``: the ``/daskdist`` page of
the Dask dashboard. ``timeline``: Chrome traces of the replicas' steps.
"""
