"""Every metric the Grafana dashboard (deploy/grafana) queries exists on a running server, with the labels
its queries match and group by (tests/static/test_deploy.py checks the dashboard's structure)."""

from __future__ import annotations

import re
import urllib.request

import pytest

from client import TTSClient
from tests.static import dashboard

pytestmark = pytest.mark.integration

# Labels Prometheus adds when it scrapes (instance, job) or that a Kubernetes scrape config usually adds.
SCRAPE_LABELS = {"instance", "job", "namespace", "pod"}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+\S+")
_LABEL = re.compile(r'(\w+)="((?:\\.|[^"\\])*)"')


@pytest.fixture(scope="module")
def exposed(server) -> dict[str, list[dict[str, str]]]:
    """metric sample name -> the label sets of its samples, scraped after one request went through (so
    that the histograms have observations)."""
    chunks = list(TTSClient(f"127.0.0.1:{server.ports.grpc}", timeout=30).stream(
        "Dashboard", seed=3, parameters={"max_patches": 4, "chunk_first": 2, "chunk_next": 2}))  # fmt: skip
    assert chunks
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples.setdefault(m.group(1), []).append(dict(_LABEL.findall(m.group(2) or "")))
    assert "tts_first_chunk_seconds_bucket" in samples and "nv_inference_request_success" in samples
    return samples


def test_every_dashboard_metric_exists(exposed):
    missing = {}
    for where, expr in dashboard.queries(dashboard.load()):
        for name in dashboard.metric_names(expr):
            if name not in exposed:
                missing.setdefault(name, []).append(where)
    assert not missing, f"queried but not exposed by the server: {missing}"


def test_dashboard_labels_exist(exposed):
    """Labels in matchers and by/on clauses are ones the metrics carry, and literal values occur."""
    problems = []
    for where, expr in dashboard.queries(dashboard.load()):
        names = dashboard.metric_names(expr)
        for name, matchers in dashboard.selectors(expr):
            label_sets = exposed.get(name, [])
            for label, op, value in matchers:
                if label in SCRAPE_LABELS:
                    continue
                values = {s[label] for s in label_sets if label in s}
                if not values:
                    problems.append(f"{where}: {name} has no label {label!r}")
                elif op == "=" and "$" not in value and value not in values:
                    problems.append(f"{where}: {name}{{{label}={value!r}}} matches nothing (values {sorted(values)})")
        for label in dashboard.grouping_labels(expr) - SCRAPE_LABELS:
            if not any(label in s for name in names for s in exposed.get(name, [])):
                problems.append(f"{where}: no metric of the query has label {label!r}")
    assert not problems, "\n".join(problems)


def test_capacity_gauge_is_the_slot_count(server):
    """The dashboard's capacity line: the generator reports the slots it serves (the fixture's 4)."""
    assert server.metrics()["tts_generator_slots"] == 4
