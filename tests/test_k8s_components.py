"""Offline validation of the optional components k8s/components/ingress and k8s/components/monitoring.

An operator's overlay takes the GPU overlay with both components; it is rendered with the real
`kubectl kustomize` and checked as tests/test_k8s.py checks the rest of k8s/:

- the core documents: strictly against the Kubernetes schemas, and every rule of tests/test_k8s.py;
- the custom resources (Gateway API Gateway and HTTPRoute, Prometheus Operator PodMonitor and
  PrometheusRule): strictly against their published models (tests/k8s_schemas/validate.mjs: the
  kubernetes-models validators, and the TypeScript compiler's excess-property check for unknown fields);
- the rules that matter here (ingress_problems, monitoring_problems), every alert and dashboard query
  parsed by the real `promtool` (Debian's prometheus package, installed with apt-get when missing), the
  alerts unit-tested with `promtool test rules`, and every metric they name one the services export.

Each rule has a test that breaks a rendered manifest and expects the rule to notice. No cluster, no network.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import StageMetrics
from services.gateway.metrics import GatewayMetrics
from services.talker.metrics import TalkerMetrics
from tests.debian_packages import ensure_program
from tests.test_k8s import (CELL, COMMON_RULES, GATEWAY, K8S, containers, find, kn, of_kind, pod_labels, pod_spec,
                            render, schema_problems, selects)

SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
PROMTOOL = Path("/usr/bin/promtool")  # Debian's prometheus package
CUSTOM_GROUPS = ("gateway.networking.k8s.io", "monitoring.coreos.com")
LONGEST_CALL_S = 3600  # the proxy's request timeouts must let a call this long through
DASHBOARD_TOPICS = {  # what an operator must see, by the metric that shows it
    "sessions": "gateway_sessions_active", "refusals": "gateway_sessions_refused_total",
    "ticks within 80 ms": "duplex_talker_tick_seconds_bucket",
    "sessions behind": "duplex_talker_sessions_behind_bucket",
    "frame latency": "gateway_frame_latency_seconds_bucket", "first audio": "duplex_talker_prefill_seconds_bucket",
    "prefill queue": "duplex_talker_prefill_wait_estimate_seconds",
    "GPU memory": "duplex_stage_gpu_memory_allocated_bytes",
}
ALERT_TOPICS = {"ticks under 99.5 %": "duplex_talker_tick_seconds_bucket",
                "refusals rising": "gateway_sessions_refused_total", "a cell out of service": "gateway_cell_serving"}
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without", "on",
    "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "abs", "clamp_min", "le",
    "topk", "bottomk", "absent", "vector", "scalar", "time", "e", "inf", "nan",
}


def is_custom(d: dict) -> bool:
    return d["apiVersion"].split("/")[0] in CUSTOM_GROUPS


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[dict]:
    user = tmp_path_factory.mktemp("components-overlay")
    rel = Path(os.path.relpath(K8S, user))
    (user / "kustomization.yaml").write_text(
        f"resources: [{rel / 'overlays/gpu'}]\n"
        f"components: [{rel / 'components/ingress'}, {rel / 'components/monitoring'}]\n")
    return render(user)


def ensure_promtool() -> str:
    return str(ensure_program(PROMTOOL, "prometheus"))


# ---------------------------------------------------------------- what the services export


def exported_metrics() -> set[str]:
    """Every sample name the gateway and a stage (with the talker's own and the GPU gauges) can expose."""
    stage = StageMetrics("talker")
    TalkerMetrics(stage)
    stage.track_gpu("cuda")  # registers the GPU gauges; nothing touches CUDA until a scrape reads them
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names = set()
    for text in (GatewayMetrics().render().decode(), generate_latest(stage.registry).decode()):
        for family in text_string_to_metric_families(text):
            names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, groupings, ranges and strings cut)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    return {t for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if t not in PROMQL_WORDS}


def dashboard(docs: list[dict]) -> dict:
    return json.loads(find(docs, "ConfigMap", "personaplex-dashboard")["data"]["personaplex.json"])


def dashboard_exprs(docs: list[dict]) -> list[str]:
    return [t["expr"] for p in dashboard(docs)["panels"] for t in p["targets"]]


def alert_rules(docs: list[dict]) -> list[dict]:
    return [r for pr in of_kind(docs, "PrometheusRule") for g in pr["spec"]["groups"] for r in g["rules"]]


def seconds(duration: str) -> float:
    """A Gateway API duration ('1h', '90s', '1h30m', '500ms') in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"([0-9]+)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(int(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------- rules


# The validator's answer per set of custom documents (their JSON text): it is a pure function of them, and
# every breakage test first checks the unbroken components, the same documents each time (one node run,
# not one per test, for those).
_SCHEMA_PROBLEMS: dict[str, list[str]] = {}


def custom_schema_problems(docs: list[dict]) -> list[str]:
    """The custom resources validate strictly against the published Gateway API and Prometheus Operator models."""
    if not (SCHEMAS / "node_modules" / "typescript").is_dir():
        pytest.fail(f"{SCHEMAS}/node_modules is missing: `make setup-k8s-schemas` (part of `make test`)")
    text = json.dumps([d for d in docs if is_custom(d)])
    if text in _SCHEMA_PROBLEMS:
        return list(_SCHEMA_PROBLEMS[text])
    path = SCHEMAS / f".docs-{os.getpid()}.json"
    path.write_text(text)
    try:
        done = subprocess.run(["node", str(SCHEMAS / "validate.mjs"), str(path)], capture_output=True, text=True,
                              timeout=120)
    finally:
        path.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    _SCHEMA_PROBLEMS[text] = json.loads(done.stdout)
    return list(_SCHEMA_PROBLEMS[text])


def ingress_problems(docs: list[dict]) -> list[str]:
    """From outside: an HTTPS listener with its certificate from a Secret, a route to the gateway Service's
    port with timeouts longer than a call, and the gateway's port reachable only from selected peers."""
    out = []
    gateways = {g["metadata"]["name"]: g for g in of_kind(docs, "Gateway")}
    https = {(name, ln["name"]): ln for name, g in gateways.items() for ln in g["spec"]["listeners"]
             if ln["protocol"] == "HTTPS"}
    if not https:
        out.append("no Gateway has an HTTPS listener")
    for (name, listener), ln in https.items():
        refs = ln.get("tls", {}).get("certificateRefs", [])
        if ln.get("tls", {}).get("mode", "Terminate") != "Terminate" or not refs or any(
                r.get("kind", "Secret") != "Secret" or r.get("group", "") != "" for r in refs):
            out.append(f"Gateway/{name} listener {listener}: TLS is not terminated with a certificate from a Secret")
    routes = of_kind(docs, "HTTPRoute")
    if not routes:
        out.append("no HTTPRoute")
    gw_svc = next((s for s in of_kind(docs, "Service") if selects(s["spec"].get("selector"),
                                                                  pod_labels(find(docs, *GATEWAY)))), None)
    for r in routes:
        for parent in r["spec"].get("parentRefs", []):
            if (parent["name"], parent.get("sectionName")) not in https:
                out.append(f"{kn(r)}: parent {parent} is not an HTTPS listener of a Gateway here")
            elif set(r["spec"].get("hostnames", [])) - {https[(parent["name"], parent["sectionName"])].get("hostname")}:
                out.append(f"{kn(r)}: hostnames {r['spec'].get('hostnames')} are not its listener's")
        for i, rule in enumerate(r["spec"]["rules"]):
            for b in rule.get("backendRefs", []):
                ports = {p["port"] for p in gw_svc["spec"]["ports"]} if gw_svc else set()
                if gw_svc is None or b["name"] != gw_svc["metadata"]["name"] or b.get("port") not in ports:
                    out.append(f"{kn(r)} rule {i}: backend {b} is not a port of the gateway's Service")
            t = rule.get("timeouts", {})
            for key in ("request", "backendRequest"):
                if key not in t or seconds(t[key]) < LONGEST_CALL_S:
                    out.append(f"{kn(r)} rule {i}: timeouts.{key} {t.get(key)} is shorter than a {LONGEST_CALL_S} s "
                               "call (or the implementation's default)")
    listen = {p["containerPort"] for c in containers(pod_spec(find(docs, *GATEWAY))) for p in c.get("ports", [])}
    gw_labels = pod_labels(find(docs, *GATEWAY))
    for pol in of_kind(docs, "NetworkPolicy"):
        if not selects(pol["spec"]["podSelector"].get("matchLabels"), gw_labels):
            continue
        for i, rule in enumerate(pol["spec"].get("ingress", [])):
            if not {p.get("port") for p in rule.get("ports", [])} & listen:
                continue
            peers = rule.get("from", [])
            if not peers or any(set(p) - {"namespaceSelector", "podSelector"} or not p.get("namespaceSelector", {})
                                .get("matchLabels") for p in peers):
                out.append(f"{kn(pol)} rule {i}: the gateway's port is open to peers other than named namespaces "
                           f"(an X-Forwarded-For from them would be believed): {peers}")
    return out


def monitoring_problems(docs: list[dict]) -> list[str]:
    """Every metrics port is scraped by a PodMonitor; the alerts and the dashboard read only metrics the
    services export, and cover what an operator must see."""
    out = []
    monitors = of_kind(docs, "PodMonitor")
    for w in (find(docs, *CELL), find(docs, *GATEWAY)):
        scraped = {(e["port"], e.get("path", "/metrics")) for m in monitors
                   if selects(m["spec"]["selector"].get("matchLabels"), pod_labels(w))
                   for e in m["spec"]["podMetricsEndpoints"]}
        for c in containers(pod_spec(w)):
            for p in c.get("ports", []):
                metrics_port = p.get("name", "").endswith("metrics") or (w["kind"] == "Deployment"
                                                                         and p.get("name") == "http")
                if metrics_port and (p["name"], "/metrics") not in scraped:
                    out.append(f"{kn(w)}/{c['name']}: port {p['name']} is scraped by no PodMonitor")
    exported = exported_metrics()
    rules = alert_rules(docs)
    exprs = [("alert " + r.get("alert", r.get("record", "?")), r["expr"]) for r in rules]
    exprs += [("dashboard", e) for e in dashboard_exprs(docs)]
    for where, expr in exprs:
        for name in sorted(metric_names(expr) - exported):
            out.append(f"{where}: {name} is not a metric the services export")
    read = {name for _, e in exprs[len(rules):] for name in metric_names(e)}
    out += [f"no dashboard panel shows {topic} ({m})" for topic, m in DASHBOARD_TOPICS.items() if m not in read]
    alerted = {name for r in rules if "alert" in r for name in metric_names(r["expr"])}
    out += [f"no alert for {topic} ({m})" for topic, m in ALERT_TOPICS.items() if m not in alerted]
    return out


def promql_problems(docs: list[dict], tmp: Path) -> list[str]:
    """promtool parses every alert rule and every dashboard query (Grafana's $__rate_interval as 1m)."""
    groups = [g for pr in of_kind(docs, "PrometheusRule") for g in pr["spec"]["groups"]]
    panels = [{"record": f"dashboard:panel_{i}", "expr": e.replace("$__rate_interval", "1m")}
              for i, e in enumerate(dashboard_exprs(docs))]
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [*groups, {"name": "dashboard", "rules": panels}]}))
    done = subprocess.run([ensure_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    return [] if done.returncode == 0 else [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


# ---------------------------------------------------------------- the tests


def is_dashboard(d: dict) -> bool:
    return d["kind"] == "ConfigMap" and d["metadata"]["name"] == "personaplex-dashboard"


@pytest.mark.parametrize("rule", COMMON_RULES, ids=[r.__name__ for r in COMMON_RULES])
def test_the_core_documents_follow_every_rule_of_k8s(docs, rule):
    """The dashboard's ConfigMap holds a file, not a service's environment: it is checked on its own."""
    core = [d for d in docs if not is_custom(d) and not is_dashboard(d)]
    problems = rule(core)
    assert problems == [], f"{rule.__doc__}\n  " + "\n  ".join(problems)
    assert schema_problems([d for d in docs if is_dashboard(d)]) == []


@pytest.mark.parametrize("rule", [custom_schema_problems, ingress_problems, monitoring_problems],
                         ids=lambda r: r.__name__)
def test_the_components_follow_their_rules(docs, rule):
    problems = rule(docs)
    assert problems == [], f"{rule.__doc__}\n  " + "\n  ".join(problems)


def test_every_query_parses(docs, tmp_path):
    assert promql_problems(docs, tmp_path) == []


def test_the_components_add_only_what_they_say(docs):
    base = render(K8S / "overlays" / "gpu")
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("personaplex-conf"))
    added = sorted(kn(d) for d in docs if kn(d) not in {kn(b) for b in base} and d is not config)
    assert added == ["ConfigMap/personaplex-dashboard", "Gateway/personaplex", "HTTPRoute/personaplex",
                     "PodMonitor/personaplex-cells", "PodMonitor/personaplex-gateway", "PrometheusRule/personaplex"]
    assert all(d["metadata"].get("namespace") == "personaplex" for d in docs if kn(d) in added)
    # The configuration gains one key: the proxies whose X-Forwarded-For the gateway believes
    # (service_config_problems loads it into the gateway's config).
    base_config = next(d for d in base if d["kind"] == "ConfigMap")
    assert set(config["data"]) - set(base_config["data"]) == {"GATEWAY_TRUSTED_PROXIES"}


ALERT_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # cell-0: 99 % of ticks within 80 ms (late); cell-1: 99.9 % (fine)
      - series: 'duplex_talker_tick_seconds_bucket{namespace="personaplex",pod="cell-0",le="0.08"}'
        values: '0+742x30'
      - series: 'duplex_talker_tick_seconds_count{namespace="personaplex",pod="cell-0"}'
        values: '0+750x30'
      - series: 'duplex_talker_tick_seconds_bucket{namespace="personaplex",pod="cell-1",le="0.08"}'
        values: '0+749x30'
      - series: 'duplex_talker_tick_seconds_count{namespace="personaplex",pod="cell-1"}'
        values: '0+750x30'
      # one open in ten refused
      - series: 'gateway_sessions_refused_total{namespace="personaplex",protocol="realtime",code="resource_exhausted"}'
        values: '0+1x30'
      - series: 'gateway_sessions_opened_total{namespace="personaplex",protocol="realtime"}'
        values: '0+9x30'
      # cell a goes out of service at minute 10; cell b serves
      - series: 'gateway_cell_serving{namespace="personaplex",pod="gateway-x",cell="a"}'
        values: '1x10 0x20'
      - series: 'gateway_cell_serving{namespace="personaplex",pod="gateway-x",cell="b"}'
        values: '1x30'
    alert_rule_test:
      - eval_time: 20m
        alertname: PersonaplexTalkerTicksLate
        exp_alerts:
          - exp_labels: {severity: warning, namespace: personaplex, pod: cell-0}
      - eval_time: 20m
        alertname: PersonaplexRefusalsRising
        exp_alerts:
          - exp_labels: {severity: warning, namespace: personaplex}
      - eval_time: 11m
        alertname: PersonaplexCellOutOfService
      - eval_time: 13m
        alertname: PersonaplexCellOutOfService
        exp_alerts:
          - exp_labels: {severity: critical, namespace: personaplex, cell: a}
"""


def test_the_alerts_fire_on_what_they_name_and_not_before(docs, tmp_path):
    """promtool test rules: late ticks on one cell, one open in ten refused, one cell out of service;
    the alerts name them (and only them) after their `for`, a healthy cell raises nothing."""
    groups = [g for pr in of_kind(docs, "PrometheusRule") for g in pr["spec"]["groups"]]
    for g in groups:
        for r in g["rules"]:
            r["annotations"] = {}  # templates are Alertmanager's to render; the test compares labels
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests.yaml").write_text(ALERT_TESTS)
    done = subprocess.run([ensure_promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- the rules can fail


def _route_rule(d):
    return find(d, "HTTPRoute", "personaplex")["spec"]["rules"][0]


def _monitor(d, name):
    return find(d, "PodMonitor", name)["spec"]


def _dashboard_target(d, text):
    cm = find(d, "ConfigMap", "personaplex-dashboard")
    dash = json.loads(cm["data"]["personaplex.json"])
    dash["panels"][0]["targets"][0]["expr"] = text
    cm["data"]["personaplex.json"] = json.dumps(dash)


def _gateway_policy(d):
    return find(d, "NetworkPolicy", "gateway-ingress")["spec"]["ingress"][0]


BREAKAGES = {
    "unknown route field": (custom_schema_problems, lambda d: _route_rule(d).update(timeout="1h")),
    "unknown monitor field": (custom_schema_problems,
                              lambda d: _monitor(d, "personaplex-gateway")["podMetricsEndpoints"][0].update(pth="/m")),
    "bad duration": (custom_schema_problems, lambda d: _route_rule(d)["timeouts"].update(request="an hour")),
    "listener without tls": (ingress_problems,
                             lambda d: find(d, "Gateway", "personaplex")["spec"]["listeners"][0].pop("tls")),
    "short timeout": (ingress_problems, lambda d: _route_rule(d)["timeouts"].update(backendRequest="30s")),
    "no timeouts": (ingress_problems, lambda d: _route_rule(d).pop("timeouts")),
    "wrong backend port": (ingress_problems, lambda d: _route_rule(d)["backendRefs"][0].update(port=8000)),
    "gateway port open to all": (ingress_problems, lambda d: _gateway_policy(d).pop("from")),
    "gateway port open to a CIDR": (ingress_problems,
                                    lambda d: _gateway_policy(d)["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}})),
    "talker port unscraped": (monitoring_problems, lambda d: _monitor(d, "personaplex-cells")["podMetricsEndpoints"]
                              .pop(1)),
    "dashboard metric typo": (monitoring_problems, lambda d: _dashboard_target(d, "sum(gateway_session_active)")),
    "topic dropped": (monitoring_problems, lambda d: _dashboard_target(d, "sum(gateway_frames_in_total)")),
    "alert on a made-up metric": (monitoring_problems, lambda d: alert_rules(d)[2].update(
        expr="max(gateway_cells_serving) == 0")),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_rule_catches_broken_component(docs, name):
    rule, breaks = BREAKAGES[name]
    broken = copy.deepcopy(docs)
    assert rule(broken) == [], "the unbroken components must pass first"
    breaks(broken)
    assert rule(broken), f"{rule.__name__} did not notice: {name}"


def test_promtool_catches_a_query_that_does_not_parse(docs, tmp_path):
    broken = copy.deepcopy(docs)
    _dashboard_target(broken, "sum(rate(gateway_frames_in_total[1m])")
    assert promql_problems(broken, tmp_path)
