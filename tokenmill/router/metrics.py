"""The router's own Prometheus metrics (``GET /metrics`` of ``tokenmill router``).

- ``tokenmill:router_requests_total`` (counter): requests sent to a backend, by ``backend``
  and HTTP ``status`` (``error`` when it failed before answering: refused, then retried
  elsewhere, or a 502)
- ``tokenmill:router_routing_decisions_total`` (counter): by ``backend`` and ``reason``
  (prefix, session, roundrobin, load)
- ``tokenmill:router_retries_total`` (counter): requests routed again after a backend
  refused the connection, by the ``backend`` that refused
- ``tokenmill:router_prefix_queried_chars_total`` / ``prefix_matched_chars_total``
  (counters): prompt characters looked up in the prefix map, and found (prefixaware)
- ``tokenmill:router_in_flight_requests`` (gauge): by ``backend``
- ``tokenmill:router_backend_healthy`` (gauge): 1 or 0, by ``backend``
- ``tokenmill:router_time_to_first_byte_seconds`` / ``request_duration_seconds``
  (histograms): request sent -> first response bytes / response end, by ``backend``
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

PREFIX = "tokenmill:router_"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class RouterMetrics:
    """The collectors, in their own registry."""

    def __init__(self) -> None:
        disable_created_metrics()  # (as the server's: the *_created series double the output)
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests", "Proxied requests.", ["backend", "status"], registry=registry
        )
        self.decisions = Counter(
            PREFIX + "routing_decisions",
            "Routing decisions.",
            ["backend", "reason"],
            registry=registry,
        )
        self.retries = Counter(
            PREFIX + "retries",
            "Requests routed again after a backend refused the connection.",
            ["backend"],
            registry=registry,
        )
        self.queried_chars = Counter(
            PREFIX + "prefix_queried_chars",
            "Prompt characters looked up in the prefix map.",
            registry=registry,
        )
        self.matched_chars = Counter(
            PREFIX + "prefix_matched_chars",
            "Prompt characters found in the prefix map.",
            registry=registry,
        )
        self.in_flight = Gauge(
            PREFIX + "in_flight_requests",
            "Requests whose responses have not ended.",
            ["backend"],
            registry=registry,
        )
        self.healthy = Gauge(
            PREFIX + "backend_healthy",
            "1 while the backend is healthy.",
            ["backend"],
            registry=registry,
        )
        self.ttfb = Histogram(
            PREFIX + "time_to_first_byte_seconds",
            "Request sent to the first response bytes (seconds).",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Request sent to the end of the response (seconds).",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def backend_changed(self, url: str, healthy: bool | None) -> None:
        """Follow a backend's health; ``None``: it left the pool."""
        if healthy is None:
            for gauge in (self.healthy, self.in_flight):
                try:
                    gauge.remove(url)
                except KeyError:
                    pass
            return
        self.healthy.labels(url).set(1 if healthy else 0)
