"""What ``tokenmill serve`` offers to watch it: vLLM-named metrics and the live dashboard.

- ``--metrics-compat vllm``: ``/metrics`` also exports every engine metric under vLLM's
  ``vllm:`` name, so Grafana dashboards, alerts and autoscalers written for vLLM work as
  they are (``tokenmill.metrics.VllmNamesCollector``).
- ``/dashboard`` (``--disable-dashboard`` turns it off): the live web view
  (``tokenmill.entrypoints.dashboard``).
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.dashboard.routes import install_dashboard
from tokenmill.entrypoints.dashboard.timeseries import DashboardStatLogger
from tokenmill.metrics import LoggingStatLogger, PrometheusStatLogger, VllmNamesCollector

METRICS_COMPAT_CHOICES = ("none", "vllm")


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    """The server flags of metrics and the dashboard."""
    group = parser.add_argument_group("observability")
    group.add_argument(
        "--metrics-compat",
        choices=METRICS_COMPAT_CHOICES,
        default="none",
        help="vllm: /metrics also exports each engine metric under vLLM's name (vllm: "
        "instead of tokenmill:), for dashboards and autoscalers made for vLLM. (default: none)",
    )
    group.add_argument(
        "--disable-dashboard",
        action="store_true",
        help="Do not serve the live web view at /dashboard.",
    )


def make_stat_loggers(config: EngineConfig, registry: CollectorRegistry) -> list[Any]:
    """The engine's stat loggers: Prometheus collectors, the periodic log line and the
    dashboard's recent history (none with ``--disable-log-stats``)."""
    if config.disable_log_stats:
        return []
    name = config.model_config.served_model_name
    lora = config.lora_config
    return [
        PrometheusStatLogger(
            name, registry, config.cache_config, config.speculative_config,
            lora.max_loras if lora is not None else None,
        ),
        LoggingStatLogger(),
        DashboardStatLogger(),
    ]


def install_observability(
    app: FastAPI, engine: Any, args: argparse.Namespace, registry: CollectorRegistry
) -> None:
    """Add the vLLM metric names (``--metrics-compat vllm``) and the dashboard (unless
    ``--disable-dashboard``) to the server ``app`` of ``engine``."""
    if getattr(args, "metrics_compat", "none") == "vllm":
        for stat_logger in getattr(engine, "stat_loggers", []):
            if isinstance(stat_logger, PrometheusStatLogger):
                registry.register(VllmNamesCollector(stat_logger.engine_registry))
    if not getattr(args, "disable_dashboard", False):
        install_dashboard(app, engine, getattr(args, "api_key", None))
