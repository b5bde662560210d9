"""`hpref serve`'s metrics: recorded by each replica through Ray's metrics API, read back for `/metrics`.

A replica records its requests (by endpoint and status), their latency, the size of each packed
pass and how many requests it holds (`ReplicaMetrics`, with `ray.util.metrics`). Ray's metrics agent
on each node aggregates what every process there records and exports it in Prometheus text format,
beside Ray Serve's own figures (the proxy's requests and errors, the 503s it sheds, its queue,
replica health: `ray_serve_*`). `/metrics` gathers the export of every live node of the cluster,
keeps hpref's families (renamed `hpref_serve_*`) and Ray Serve's, and adds what the replica knows
now: running replicas and the model's name and version. Ray exports on its report interval (`hpref
serve`'s local cluster: `METRICS_REPORT_MS`), so a figure may lag by that much.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

#: how often Ray's processes report their metrics to the node's agent, on a cluster `hpref serve`
#: starts (Ray's default, 10 s, would leave a scrape up to 10 s behind)
METRICS_REPORT_MS = 1000
#: our families' names as Ray exports them (Ray prefixes `ray_`), and as /metrics shows them
RAY_PREFIX = "ray_hpref_serve_"
PREFIX = "hpref_serve_"
#: Ray Serve's own families that say something about the service (requests, errors, queues, health)
RAY_SERVE_PREFIX = "ray_serve_"
#: Ray's bookkeeping labels, the same on every sample of a node (a scraper adds its own)
DROPPED_LABELS = ("SessionName", "Version", "otel_scope_name", "otel_scope_schema_url", "otel_scope_version")
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def batch_buckets(max_batch_size: int) -> list[float]:
    """Powers of two up to the largest batch a replica forms."""
    bounds, size = [], 1
    while size < max_batch_size:
        bounds.append(float(size))
        size *= 2
    return [*bounds, float(max_batch_size)]


class ReplicaMetrics:
    """One replica's figures, recorded through Ray's metrics API (built inside the replica)."""

    def __init__(self, max_batch_size: int) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.requests = Counter(
            "hpref_serve_requests", description="Requests answered, by endpoint and HTTP status.",
            tag_keys=("endpoint", "status"),
        )  # fmt: skip
        self.latency = Histogram(
            "hpref_serve_request_seconds", boundaries=LATENCY_BUCKETS_S, tag_keys=("endpoint",),
            description="Seconds from a replica taking a request to answering it.",
        )  # fmt: skip
        self.batch = Histogram(
            "hpref_serve_batch_size", description="Requests scored together in one packed pass.",
            boundaries=batch_buckets(max_batch_size),
        )  # fmt: skip
        self.expired = Counter(
            "hpref_serve_expired",
            description="Requests whose deadline passed before they were scored (dropped).",
        )
        self.held = Gauge(
            "hpref_serve_requests_in_replica",
            description="Requests a replica holds (queued for a pass or in one).",
        )
        self.held_now = 0
        self.held.set(0)

    def taken(self) -> None:
        self.held_now += 1
        self.held.set(self.held_now)

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.held_now -= 1
        self.held.set(self.held_now)
        self.requests.inc(1, tags={"endpoint": endpoint, "status": str(status)})
        self.latency.observe(seconds, tags={"endpoint": endpoint})

    def scored(self, batch_size: int, expired: int) -> None:
        if batch_size:
            self.batch.observe(batch_size)
        if expired:
            self.expired.inc(expired)


def node_exports() -> list[str]:
    """The metrics endpoint of every live node of the cluster this process belongs to."""
    import ray

    return [
        f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for node in ray.nodes()
        if node.get("Alive") and node.get("MetricsExportPort")
    ]


def fetch(urls: Iterable[str], timeout_s: float = 5.0) -> list[str]:
    """Each endpoint's text; a node that does not answer is left out (it is gone or restarting)."""
    texts = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (the cluster's own)
                texts.append(reply.read().decode("utf-8", "replace"))
        except OSError:
            continue
    return texts


def render(exports: Iterable[str], info: dict[str, Any], replicas_running: int) -> bytes:
    """Prometheus text: hpref's and Ray Serve's families from the nodes' exports, and the gauges of
    the moment (replicas running, the model's name and version)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for text in exports:
        for family in text_string_to_metric_families(text):
            if family.name.startswith(RAY_PREFIX):
                name = PREFIX + family.name.removeprefix(RAY_PREFIX)
            elif family.name.startswith(RAY_SERVE_PREFIX):
                name = family.name
            else:
                continue
            kept = families.setdefault(name, Metric(name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k not in DROPPED_LABELS}
                sample_name = sample.name.replace(family.name, name, 1)
                kept.add_sample(sample_name, labels, sample.value, sample.timestamp, sample.exemplar)
    running = GaugeMetricFamily(PREFIX + "replicas_running", "Replicas Ray Serve reports as running.")
    running.add_metric([], replicas_running)
    model = InfoMetricFamily(PREFIX + "model", "The export this service answers with.")
    model.add_metric([], {k: str(info.get(k)) for k in ("model", "kind", "head", "step", "hpref_version")})

    class _Collected:
        def collect(self) -> Iterator[Metric]:
            yield running
            yield model
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected())
    return generate_latest(registry)
