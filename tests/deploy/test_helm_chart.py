"""The Helm chart: ``helm lint``, ``helm template`` over the value sets that matter, and the
rendered manifests validated against the Kubernetes JSON schemas (kubernetes-validate).

Custom resources (ServiceMonitor, PrometheusRule, KEDA's ScaledObject) have no schema in
that package: their fields are checked here against what their operators read.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import REPO, require_tool

CHART = REPO / "deploy" / "helm" / "tokenmill"
KUBERNETES_VERSION = "1.33.0"
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}
GPU_VALUES = [
    "model.path=/models/Llama-3.1-8B-Instruct",
    "model.servedModelName=llama-3.1-8b",
    "model.pvc.claimName=models",
    "tritonCache.pvc.claimName=triton-cache",
    "gpus=2",
    "vllmMetricNames=true",
    "serviceMonitor.enabled=true",
    "prometheusRule.enabled=true",
    "grafanaDashboard.enabled=true",
    "autoscaling.keda.enabled=true",
    "apiKeySecret.name=tokenmill-key",
    "extraArgs={--max-model-len,8192}",
]
CPU_VALUES = [
    "image.tag=0.1.0-cpu",
    "gpus=0",
    "model.hostPath.path=/srv/models",
    "model.path=/models/SmolLM2.gguf",
    "router.enabled=false",
    "dashboard=false",
    "autoscaling.hpa.enabled=true",
]


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [require_tool("helm"), *args], capture_output=True, text=True, timeout=120
    )


def render(values: list[str]) -> list[dict[str, Any]]:
    sets = [a for v in values for a in ("--set", v)]
    result = helm("template", "tm", str(CHART), "--namespace", "serving", *sets)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate(docs: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            assert doc["metadata"]["name"] and isinstance(doc["spec"], dict)
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, [(d["kind"], d["metadata"]["name"]) for d in docs]
    return found[0]


@pytest.mark.parametrize(
    "values", [[], GPU_VALUES, CPU_VALUES], ids=["default", "cuda-values", "cpu-values"]
)
def test_lint_and_schema(values):
    sets = [a for v in values for a in ("--set", v)]
    lint = helm("lint", "--strict", str(CHART), *sets)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    validate(render(values))


def test_cuda_deployment():
    docs = render(GPU_VALUES)
    engine = by_kind(docs, "Deployment", "tm-tokenmill")
    assert "replicas" not in engine["spec"]  # KEDA owns the replica count
    pod = engine["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["args"][:3] == ["/models/Llama-3.1-8B-Instruct", "--served-model-name",
                                      "llama-3.1-8b"]  # fmt: skip
    assert ["--metrics-compat", "vllm"] == container["args"][7:9]
    assert container["args"][-2:] == ["--max-model-len", "8192"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "tokenmill-key"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # slow model loads
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "models"
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == "triton-cache"
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    router = by_kind(docs, "Deployment", "tm-tokenmill-router")["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert args[:3] == ["--backend", "http://tm-tokenmill-engines.serving.svc:8000",
                        "--resolve-backends"]  # fmt: skip
    headless = by_kind(docs, "Service", "tm-tokenmill-engines")
    assert headless["spec"]["clusterIP"] == "None"
    keda = by_kind(docs, "ScaledObject")
    trigger = keda["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    assert "sum(tokenmill:num_requests_waiting{" in trigger["metadata"]["query"]
    assert 'model_name="llama-3.1-8b"' in trigger["metadata"]["query"]
    monitor = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_rules_and_dashboard_are_the_repository_files():
    docs = render(GPU_VALUES)
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "tokenmill-rules.yaml").read_text())
    assert by_kind(docs, "PrometheusRule")["spec"] == rules
    dashboard = json.loads((REPO / "deploy" / "grafana" / "tokenmill.json").read_text())
    config_map = by_kind(docs, "ConfigMap", "tm-tokenmill-dashboard")
    assert json.loads(config_map["data"]["tokenmill.json"]) == dashboard
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_cpu_deployment_with_hpa():
    docs = render(CPU_VALUES)
    assert not [d for d in docs if "router" in d["metadata"]["name"]]
    container = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "--disable-dashboard" in container["args"]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]
    assert metric["metric"]["name"] == "tokenmill_num_requests_waiting"
    volume = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][-1]
    assert volume["hostPath"]["path"] == "/srv/models"


def test_both_autoscalers_are_refused():
    sets = ["--set", "autoscaling.keda.enabled=true", "--set", "autoscaling.hpa.enabled=true"]
    result = helm("template", "tm", str(CHART), *sets)
    assert result.returncode != 0
    assert "enable keda or hpa, not both" in result.stderr


def test_values_are_documented():
    """Every top-level key of values.yaml has a comment above it or inside its block."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    top_level = [i for i, line in enumerate(lines) if line and line[0].isalpha()]
    for start, end in zip(top_level, [*top_level[1:], len(lines)], strict=True):
        block = lines[start - 1 : end]
        assert any(line.strip().startswith("#") for line in block), lines[start]
