"""The /dashboard routes over HTTP: the key check (bearer or Basic credentials, with a Basic
challenge a browser answers), the static files, the data, and ``--disable-dashboard``.

The page in a real browser is tested in tests/deploy/test_dashboard_browser.py.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from tests.entrypoints.conftest import API_KEY
from tokenmill.entrypoints.dashboard.routes import key_matches
from tokenmill.entrypoints.openai.observability import install_observability


@pytest.mark.slow
def test_dashboard_needs_the_key_as_bearer_or_basic(template_server):
    url = template_server.url
    for path in ("/dashboard", "/dashboard/api/stats", "/dashboard/static/dashboard.js"):
        missing = httpx.get(url + path, timeout=60)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"].startswith('Basic realm="tokenmill')
        assert missing.json()["error"]["message"].startswith("The dashboard needs")
        wrong = httpx.get(url + path, auth=("admin", API_KEY + "x"), timeout=60)
        assert wrong.status_code == 401
        assert httpx.get(url + path, auth=("admin", API_KEY), timeout=60).status_code == 200
        bearer = {"Authorization": f"Bearer {API_KEY}"}
        assert httpx.get(url + path, headers=bearer, timeout=60).status_code == 200
    # Basic credentials open the dashboard only: the API still wants the bearer token
    assert httpx.get(url + "/v1/models", auth=("admin", API_KEY), timeout=60).status_code == 401


@pytest.mark.slow
def test_dashboard_page_files_and_data(default_server):
    url = default_server.url
    page = httpx.get(url + "/dashboard", timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "dashboard/static/uPlot.iife.min.js" in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    script = httpx.get(url + "/dashboard/static/uPlot.iife.min.js", timeout=60)
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    assert httpx.get(url + "/dashboard/static/../routes.py", timeout=60).status_code == 404
    assert httpx.get(url + "/dashboard/static/nothing.js", timeout=60).status_code == 404
    default_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    data = httpx.get(url + "/dashboard/api/stats", timeout=60).json()
    assert data["model"]["served_model_name"] == "SmolLM2-135M-Instruct"
    assert data["model"]["max_model_len"] == 2048 and data["model"]["num_kv_blocks"] > 0
    current = data["stats"]["current"]
    assert current["requests_total"] >= 1 and current["generation_tokens_total"] >= 3
    assert data["stats"]["points"] and "ttft_p50_ms" in data["stats"]["points"][-1]


def test_disable_dashboard_serves_no_route():
    from fastapi.testclient import TestClient

    engine = SimpleNamespace(stat_loggers=[])
    for disabled, status in ((True, 404), (False, 200)):
        app = FastAPI()
        args = argparse.Namespace(disable_dashboard=disabled, api_key=None, metrics_compat="none")
        install_observability(app, engine, args, CollectorRegistry())
        with TestClient(app) as client:
            assert client.get("/dashboard").status_code == status
            assert client.get("/dashboard/static/dashboard.css").status_code == status


def test_key_matches():
    assert key_matches("Bearer k", "k") and key_matches("bearer  k ", "k")
    assert key_matches("Basic " + "dTprLXk=", "k-y")  # base64("u:k-y")
    assert not key_matches("Basic !!!", "k") and not key_matches("Digest k", "k")
    assert not key_matches("", "k")
