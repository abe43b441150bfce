"""Prometheus metrics of the replica groups, served on the scheduler's ``/metrics``.

Distributed serves ``prometheus_client``'s global registry on the dashboard's
``/metrics``; one ``DaskdistCollector`` registered there (once per process)
reports every live ``MetricsStore`` (one per scheduler in this process).
Without ``prometheus_client`` nothing is registered.

A closed group's series stay ``daskdist.metrics.closed-grace`` (default 2 min)
after the close, its rates at 0 and its counters at their final values, so
that a scrape (Prometheus' default interval is 1 min) records the last steps;
then they go away, and Prometheus marks them stale at its next scrape.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from daskdist import config
from daskdist.dashboard.stragglers import StragglerTotals

if TYPE_CHECKING:
    from daskdist.dashboard.store import MetricsStore

__all__ = ["DaskdistCollector", "register_store"]

logger = logging.getLogger(__name__)

_stores: weakref.WeakSet[MetricsStore] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


class DaskdistCollector:
    """A ``prometheus_client`` collector over the live metrics stores."""

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        steps = CounterMetricFamily("daskdist_steps", "Steps run, per replica", labels=["group", "replica"])
        samples = CounterMetricFamily("daskdist_samples", "Examples processed in steps that report them, per replica",
                                      labels=["group", "replica"])
        collectives = CounterMetricFamily("daskdist_collectives", "Collectives run inside steps, per replica",
                                          labels=["group", "replica"])
        nbytes = CounterMetricFamily("daskdist_collective_bytes", "Bytes sent by a replica's collectives in steps",
                                     labels=["group", "replica"])
        phases = HistogramMetricFamily("daskdist_step_phase_seconds",
                                       "Time of each step phase (total, input_wait, compute, allreduce, apply)",
                                       labels=["group", "replica", "phase"])
        throughput = GaugeMetricFamily("daskdist_throughput_steps_per_second",
                                       "Steps per second of a group over its recent steps", labels=["group"])
        sample_rate = GaugeMetricFamily("daskdist_throughput_samples_per_second",
                                        "Samples per second of a group over its recent steps, summed over replicas "
                                        "(absent while its steps do not report samples)", labels=["group"])
        stragglers = CounterMetricFamily("daskdist_straggler",
                                         "Collectives in which the other replicas waited for this one "
                                         "(at least daskdist.metrics.straggler-min-wait)", labels=["group", "replica"])
        waits = CounterMetricFamily("daskdist_straggler_wait_seconds",
                                    "Seconds the other replicas waited for this one in those collectives",
                                    labels=["group", "replica"])
        grace = config.get_seconds("metrics.closed-grace")
        for store in list(_stores):
            for group in store.exported_groups(grace):
                for rank, replica in sorted(group.replicas.items()):
                    labels = [group.group, str(rank)]
                    steps.add_metric(labels, replica.steps_total)
                    samples.add_metric(labels, replica.samples_total)
                    collectives.add_metric(labels, replica.collectives_total)
                    nbytes.add_metric(labels, replica.bytes_total)
                    for phase, histogram in replica.phases.items():
                        phases.add_metric([*labels, phase], histogram.cumulative(), histogram.total)
                # a closed group runs no steps: its rates are 0 while its final counts stay for the grace period
                throughput.add_metric([group.group], 0.0 if group.closed else group.throughput())
                rate = group.samples_per_second()
                if rate is not None:
                    sample_rate.add_metric([group.group], 0.0 if group.closed else rate)
                if group.size >= 2:  # one replica never waits for another
                    for rank in sorted(group.replicas):
                        totals = group.stragglers.totals.get(rank, StragglerTotals())
                        stragglers.add_metric([group.group, str(rank)], totals.count)
                        waits.add_metric([group.group, str(rank)], totals.wait)
        yield from (steps, samples, collectives, nbytes, phases, throughput, sample_rate, stragglers, waits)


def register_store(store: MetricsStore) -> bool:
    """Report ``store`` on ``/metrics``; registers the collector on first use. False without prometheus_client."""
    global _registered
    try:
        import prometheus_client
    except ImportError:
        logger.debug("prometheus_client is not installed: no daskdist metrics on /metrics")
        return False
    with _lock:
        _stores.add(store)
        if not _registered:
            # duck-typed (collect()), so prometheus_client is imported only where it is installed
            prometheus_client.REGISTRY.register(DaskdistCollector())  # type: ignore[arg-type]
            _registered = True
    return True
