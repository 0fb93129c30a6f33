"""The Helm chart in helm/maskd, rendered by the real Helm engine (helm-python-sdk bundles
libhelm_c, Helm's Go SDK behind a C ABI: no helm binary, no cluster).

Every built-in object is validated against the Kubernetes OpenAPI schemas shipped with
kubernetes-validate (strict: unknown fields are errors). Custom resources are validated, strictly,
against the CRDs of their operators kept in tests/deploy/crds/ (KubeRay v1.7.0's RayCluster,
prometheus-operator v0.93.0's ServiceMonitor; see crds/README.md), and the pod templates inside
the RayCluster are also validated as core Pods.
"""
from __future__ import annotations

import json
import pathlib
import re
import runpy
import shlex

import pytest
import yaml
from crd_validation import CRD_FILES, CRDValidationError
from crd_validation import validate as validate_crd

try:
    import helm_python as helm
except ImportError:
    pytest.skip("helm-python-sdk is not installed (pip install helm-python-sdk)", allow_module_level=True)
except Exception as exc:  # HelmLibraryError: the bundled libhelm_c does not load on this platform
    pytest.skip(f"helm-python-sdk cannot load its Helm engine (libhelm_c): {exc}", allow_module_level=True)
kv_utils = pytest.importorskip("kubernetes_validate.utils",
                               reason="kubernetes-validate is not installed (pip install kubernetes-validate)")

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "maskd"
RELEASE = "mk"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-maskd"


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"v?(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


# Objects are validated against the oldest Kubernetes the chart declares (Chart.yaml kubeVersion)
# and the newest whose schemas kubernetes-validate ships.
K8S_MIN = "{}.{}.0".format(*_major_minor(re.search(r">=\s*(\S+)", yaml.safe_load(
    (CHART / "Chart.yaml").read_text())["kubeVersion"]).group(1)))
K8S_LATEST = "{}.{}.0".format(*_major_minor(kv_utils.latest_version()))
K8S_VERSIONS = sorted({K8S_MIN, K8S_LATEST}, key=_major_minor)

METRICS = [
    "maskd_step_seconds", "maskd_mask_fill_seconds", "maskd_step_batch_size", "maskd_compile_seconds",
    "maskd_grammar_cache_hits_total", "maskd_grammar_cache_misses_total", "maskd_grammar_cache_entries",
    "maskd_live_sequences", "maskd_waiting_sequences", "maskd_open_streams", "maskd_row_bytes",
    "maskd_rows_sent_total", "maskd_row_dictionary_lookups_total", "maskd_errors_total",
]
CRDS = set(CRD_FILES)
FULL_VALUES = {
    "tls": {"enabled": True, "secretName": "maskd-tls"},
    "auth": {"enabled": True, "secretName": "maskd-auth", "secretKey": "api-token"},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                "dashboard": {"enabled": True, "folder": "LLM serving"}},
}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chart():
    try:
        loaded = helm.Chart.load(CHART)
    except (OSError, helm.HelmLibraryError) as exc:  # the bundled libhelm_c cannot load here
        pytest.skip(f"helm-python-sdk cannot load its Helm engine (libhelm_c): {exc}")
    with loaded:
        yield loaded


def render(chart, values=None) -> list[dict]:
    """Renders the chart and returns its objects (NOTES.txt and empty documents dropped)."""
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert isinstance(doc, dict), f"{path}: not a mapping"
                docs.append(doc)
    return docs


def by_kind(docs, kind) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind, name=None) -> dict:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def validate_builtin(obj: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kv_utils.validate(obj, version, strict=True)
        except kv_utils.ValidationError as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata'].get('name')} invalid for Kubernetes "
                                 f"{version}: {exc.message} at {list(exc.path)}") from exc


def check_labels(obj: dict) -> None:
    labels = obj["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "maskd"
    assert labels["app.kubernetes.io/instance"] == RELEASE
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert labels["app.kubernetes.io/version"]
    assert labels["helm.sh/chart"].startswith("maskd-")


def check_raycluster(rc: dict) -> None:
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    assert isinstance(spec["rayVersion"], str) and spec["rayVersion"]
    head = spec["headGroupSpec"]
    groups = spec["workerGroupSpecs"]
    assert groups, "RayCluster has no worker group"
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in groups]:
        # KubeRay's rayStartParams is map[string]string.
        assert all(isinstance(v, str) for v in params.values()), params
    for g in groups:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", g["groupName"])
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert isinstance(g[key], int) and g[key] >= 0
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    # Pod templates of both groups must be valid core Pods, with the Ray container first.
    for template, ray_container in [(head["template"], "ray-head")] + [(g["template"], "ray-worker") for g in groups]:
        assert template["spec"]["containers"][0]["name"] == ray_container
        validate_builtin({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": "template", **template.get("metadata", {})},
                          "spec": template["spec"]})


def check_servicemonitor(sm: dict, docs: list[dict]) -> None:
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = sm["spec"]
    assert spec["endpoints"], "ServiceMonitor without endpoints"
    selector = spec["selector"]["matchLabels"]
    scraped = [s for s in by_kind(docs, "Service")
               if selector.items() <= s["metadata"]["labels"].items()
               and s["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]]
    assert len(scraped) == 1, "the ServiceMonitor must select exactly one Service (no double scraping)"
    port_names = {p["name"] for p in scraped[0]["spec"]["ports"]}
    for ep in spec["endpoints"]:
        assert ep["port"] in port_names
        assert ep["path"] == "/metrics"
        assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", ep["interval"])


def validate_all(docs: list[dict]) -> None:
    """Every object: built-ins against the Kubernetes schemas, CRDs structurally."""
    assert docs
    seen = set()
    for obj in docs:
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in seen, f"duplicate object {key}"
        seen.add(key)
        assert len(obj["metadata"]["name"]) <= 63
        check_labels(obj)
        if obj["kind"] != "Pod" or "helm.sh/hook" not in obj["metadata"].get("annotations", {}):
            assert obj["metadata"]["namespace"] == NAMESPACE
        api = (obj["apiVersion"], obj["kind"])
        if api in CRDS:
            validate_crd(obj)
        if api == ("ray.io/v1", "RayCluster"):
            check_raycluster(obj)
        elif api == ("monitoring.coreos.com/v1", "ServiceMonitor"):
            check_servicemonitor(obj, docs)
        else:
            assert api not in CRDS
            validate_builtin(obj)


def container(pod_spec: dict, name: str) -> dict:
    matches = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(matches) == 1, f"no container {name}"
    return matches[0]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} must appear exactly once in {args}"
    return args[args.index(name) + 1]


def env_map(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# --------------------------------------------------------------------------------------------
# chart-level
# --------------------------------------------------------------------------------------------

def test_chart_metadata_and_lint(chart):
    meta = chart.metadata
    assert meta["name"] == "maskd" and meta["apiVersion"] == "v2"
    assert chart.schema is not None, "values.schema.json must ship with the chart"
    chart.validate_schema({})  # the defaults satisfy the schema
    assert _major_minor(K8S_MIN) <= _major_minor(K8S_LATEST)
    for values, kube in [({}, K8S_MIN), ({"mode": "ray"}, K8S_LATEST), (FULL_VALUES, K8S_LATEST)]:
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{kube}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], report


# --------------------------------------------------------------------------------------------
# standalone mode
# --------------------------------------------------------------------------------------------

def test_default_render_standalone(chart):
    docs = render(chart)
    validate_all(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Pod", "PodDisruptionBudget", "Service", "Service", "ServiceAccount"]
    assert not by_kind(docs, "RayCluster") and not by_kind(docs, "HorizontalPodAutoscaler")

    values = chart.values
    dep = one(docs, "Deployment", FULLNAME)
    pod = dep["spec"]["template"]
    assert dep["spec"]["replicas"] == values["replicaCount"]
    assert selects(dep["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    c = container(pod["spec"], "maskd")
    assert c["image"] == f"{values['image']['repository']}:{chart.metadata['appVersion']}"
    assert c["command"] == ["maskd"]
    args = c["args"]
    assert args[0] == "serve"
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == str(values["server"]["port"]) == "50051"
    assert flag(args, "--metrics-port") == str(values["server"]["metricsPort"]) == "9464"
    assert flag(args, "--tokenizer") == "deepseek-v4"
    assert flag(args, "--backend") == "llguidance"
    assert flag(args, "--threads") == str(values["server"]["threads"])
    for absent in ("--logits-width", "--tls-cert", "--tls-key", "--max-message-bytes", "--max-streams",
                   "--compile-timeout", "--cache-entries", "--max-grammar-bytes", "--compile-threads"):
        assert absent not in args
    assert "MASKD_AUTH_TOKEN" not in env_map(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9464}

    # Kubernetes' native gRPC probes on the gRPC port; readiness asks for the MaskService.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 50051, probe
        assert "tcpSocket" not in c[probe] and "httpGet" not in c[probe]
    assert c["readinessProbe"]["grpc"]["service"] == "maskd.v1.MaskService"
    assert "service" not in c["livenessProbe"]["grpc"]  # "" = overall server health

    # Graceful drain: preStop sleep, then SIGTERM; the grace period covers both.
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < sleep < pod["spec"]["terminationGracePeriodSeconds"]
    strategy = dep["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0

    svc = one(docs, "Service", FULLNAME)
    assert selects(svc["spec"]["selector"], pod["metadata"]["labels"])
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "grpc": (50051, "grpc"), "metrics": (9464, "metrics")}
    headless = one(docs, "Service", f"{FULLNAME}-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert selects(headless["spec"]["selector"], pod["metadata"]["labels"])

    pdb = one(docs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == 1

    test_pod = one(docs, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["args"][-1] == f"{FULLNAME}:50051"


def test_server_values_flow_into_args_probes_and_service(chart):
    values = {
        "replicaCount": 5,
        "image": {"repository": "registry.local/maskd", "tag": "1.2.3", "pullPolicy": "Always"},
        "server": {"port": 7443, "metricsPort": 9100, "tokenizer": "qwen3.6", "backend": "xgrammar",
                   "threads": 16, "logitsWidth": 151936, "compileThreads": 3, "maxMessageBytes": 134217728,
                   "maxGrammarBytes": 2097152, "compileTimeoutSeconds": 12.5, "maxStreams": 512,
                   "cacheEntries": 4096, "extraArgs": ["-v"]},
        "resources": {"requests": {"cpu": 16, "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
        "nodeSelector": {"node.kubernetes.io/pool": "cpu-maskd"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "maskd", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "maskd"}}}}]}},
        "podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"},
    }
    docs = render(chart, values)
    validate_all(docs)
    dep = one(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    c = container(spec, "maskd")
    args = c["args"]
    assert dep["spec"]["replicas"] == 5
    assert c["image"] == "registry.local/maskd:1.2.3" and c["imagePullPolicy"] == "Always"
    assert flag(args, "--port") == "7443"
    assert flag(args, "--metrics-port") == "9100"
    assert flag(args, "--tokenizer") == "qwen3.6"
    assert flag(args, "--backend") == "xgrammar"
    assert flag(args, "--threads") == "16"
    assert flag(args, "--logits-width") == "151936"
    assert flag(args, "--compile-threads") == "3"
    # Large integers must not come out in float notation (6.7e+07).
    assert flag(args, "--max-message-bytes") == "134217728"
    assert flag(args, "--max-grammar-bytes") == "2097152"
    assert flag(args, "--compile-timeout") == "12.5"
    assert flag(args, "--max-streams") == "512"
    assert flag(args, "--cache-entries") == "4096"
    assert args[-1] == "-v"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 7443
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 7443, "metrics": 9100}
    assert c["resources"]["requests"]["cpu"] == 16
    assert spec["nodeSelector"] == values["nodeSelector"]
    assert spec["tolerations"] == values["tolerations"]
    assert spec["affinity"] == values["affinity"]
    svc = one(docs, "Service", FULLNAME)
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 7443, "metrics": 9100}
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["minAvailable"] == "50%" and "maxUnavailable" not in pdb


def test_autoscaling_renders_hpa_and_drops_replicas(chart):
    docs = render(chart, {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12}})
    validate_all(docs)
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in one(docs, "Deployment")["spec"], "the HPA owns the replica count"


def test_pdb_can_be_disabled_and_exec_prestop(chart):
    docs = render(chart, {"podDisruptionBudget": {"enabled": False}, "preStop": {"type": "exec", "seconds": 7},
                          "tests": {"enabled": False}, "service": {"headless": {"enabled": False}}})
    validate_all(docs)
    assert not by_kind(docs, "PodDisruptionBudget") and not by_kind(docs, "Pod")
    assert len(by_kind(docs, "Service")) == 1
    c = container(one(docs, "Deployment")["spec"]["template"]["spec"], "maskd")
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]


# --------------------------------------------------------------------------------------------
# TLS, auth, ServiceMonitor, dashboard
# --------------------------------------------------------------------------------------------

def test_tls_auth_servicemonitor_dashboard(chart):
    docs = render(chart, FULL_VALUES)
    validate_all(docs)
    dep = one(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    c = container(spec, "maskd")
    args = c["args"]

    # TLS: the secret is mounted read-only and its files are passed to the server.
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert mount["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "maskd-tls"
    assert flag(args, "--tls-cert") == f"{mount['mountPath']}/tls.crt"
    assert flag(args, "--tls-key") == f"{mount['mountPath']}/tls.key"
    assert {i["path"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key"}
    # Kubelet gRPC probes are plaintext only: with TLS the chart falls back to TCP probes.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"]["port"] == "grpc" and "grpc" not in c[probe]

    # Auth: the token comes from the secret, never from values.
    token = env_map(c)["MASKD_AUTH_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "maskd-auth", "key": "api-token"}
    assert "value" not in token

    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"

    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "LLM serving"
    (name, text), = cm["data"].items()
    assert name.endswith(".json")
    check_dashboard(json.loads(text))


def test_grpc_probes_can_be_forced_with_tls(chart):
    docs = render(chart, {"tls": {"enabled": True, "secretName": "maskd-tls"}, "probes": {"type": "grpc"}})
    c = container(one(docs, "Deployment")["spec"]["template"]["spec"], "maskd")
    assert c["readinessProbe"]["grpc"]["port"] == 50051


def check_dashboard(dash: dict) -> None:
    assert dash["uid"] and dash["title"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    text = "\n".join(exprs)
    for metric in METRICS:
        assert re.search(rf"\b{metric}(_bucket|_sum|_count)?\b", text), f"dashboard never queries {metric}"
    for expr in exprs:
        depth = 0
        for ch in expr:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            assert depth >= 0, expr
        assert depth == 0, f"unbalanced parentheses: {expr}"
        assert expr.count("{") == expr.count("}"), expr

    def panel(title_part):
        found = [p for p in panels if title_part.lower() in p["title"].lower()]
        assert found, f"no panel titled like {title_part!r}"
        return found[0]

    step = " ".join(t["expr"] for t in panel("Step latency (p50")["targets"])
    assert "histogram_quantile(0.5," in step and "histogram_quantile(0.99," in step
    assert re.search(r"rate\(maskd_step_seconds_bucket\{", step)
    assert "maskd_mask_fill_seconds_bucket" in " ".join(t["expr"] for t in panel("Mask fill")["targets"])
    compile_ = " ".join(t["expr"] for t in panel("Compile time")["targets"])
    assert "maskd_compile_seconds_bucket" in compile_ and "backend" in compile_
    ratio = panel("cache hit ratio")["targets"][0]["expr"]
    assert "maskd_grammar_cache_hits_total" in ratio and "maskd_grammar_cache_misses_total" in ratio and "/" in ratio
    seqs = " ".join(t["expr"] for t in panel("Live and waiting")["targets"])
    assert "maskd_live_sequences" in seqs and "maskd_waiting_sequences" in seqs
    row_bytes = " ".join(t["expr"] for t in panel("Bytes per row")["targets"])
    assert "maskd_row_bytes_sum" in row_bytes and "maskd_row_bytes_count" in row_bytes
    errors = panel("Errors by kind")["targets"][0]
    assert "maskd_errors_total" in errors["expr"] and "by (kind)" in errors["expr"]
    assert errors["legendFormat"] == "{{kind}}"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}"


def test_dashboard_file_is_the_one_shipped(chart):
    shipped = json.loads((CHART / "dashboards" / "maskd-overview.json").read_text())
    check_dashboard(shipped)


# --------------------------------------------------------------------------------------------
# ray mode
# --------------------------------------------------------------------------------------------

def test_ray_mode(chart):
    values = {"mode": "ray", "server": {"tokenizer": "deepseek-v4", "threads": 4},
              "ray": {"worker": {"replicas": 3, "minReplicas": 2, "maxReplicas": 6, "threads": 12,
                                 "nodeSelector": {"pool": "cpu"},
                                 "resources": {"requests": {"cpu": "8", "memory": "16Gi"}}}}}
    docs = render(chart, values)
    validate_all(docs)
    assert not by_kind(docs, "Deployment") and not by_kind(docs, "HorizontalPodAutoscaler")
    rc = one(docs, "RayCluster", FULLNAME)

    groups = rc["spec"]["workerGroupSpecs"]
    assert len(groups) == 1
    g = groups[0]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (3, 2, 6)
    # The custom Ray resource, in KubeRay's quoted-JSON format: one unit per worker pod.
    raw = g["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"')
    assert json.loads(json.loads(raw)) == {"maskd_cpu_node": 1}
    wspec = g["template"]["spec"]
    worker = container(wspec, "ray-worker")
    assert worker["resources"]["requests"] == {"cpu": "8", "memory": "16Gi"}
    assert wspec["nodeSelector"] == {"pool": "cpu"}
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {"grpc": 50051, "metrics": 9464}
    assert worker["lifecycle"]["preStop"]["sleep"]["seconds"] > 0

    # `maskd cluster up --address auto --workers N` runs next to the Ray head.
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    hspec = head["template"]["spec"]
    side = container(hspec, "maskd-cluster")
    assert side["command"] == ["/bin/sh", "-c"]
    script = side["args"][0]
    line = next(ln for ln in script.splitlines() if "maskd cluster up" in ln)
    words = shlex.split(line)
    assert words[:4] == ["exec", "maskd", "cluster", "up"]
    assert flag(words, "--address") == "auto"
    assert flag(words, "--workers") == "3"
    assert flag(words, "--directory-port") == "50050"
    assert flag(words, "--tokenizer") == "deepseek-v4"
    assert flag(words, "--backend") == "llguidance"
    assert flag(words, "--threads") == "12"  # ray.worker.threads: the actor owns its pod
    assert flag(words, "--port") == "50051"
    assert flag(words, "--metrics-port") == "9464"
    assert "ray health-check" in script  # waits for the GCS instead of crash-looping
    assert env_map(side)["RAY_ADDRESS"]["value"] == "$(MY_POD_IP):6379"
    # The driver needs the head's session directory (/tmp/ray): both containers share /tmp.
    tmp_mounts = {c["name"]: m["name"] for c in hspec["containers"] for m in c["volumeMounts"]
                  if m["mountPath"] == "/tmp"}
    assert tmp_mounts["ray-head"] == tmp_mounts["maskd-cluster"]
    assert {p["name"]: p["containerPort"] for p in side["ports"]} == {"directory": 50050}

    directory = one(docs, "Service", f"{FULLNAME}-directory")
    assert directory["spec"]["ports"] == [{"name": "directory", "port": 50050, "targetPort": "directory",
                                           "protocol": "TCP", "appProtocol": "grpc"}]
    assert selects(directory["spec"]["selector"], head["template"]["metadata"]["labels"])
    assert not selects(directory["spec"]["selector"], g["template"]["metadata"]["labels"])
    workers = one(docs, "Service", f"{FULLNAME}-workers")
    assert workers["spec"]["clusterIP"] == "None"
    assert selects(workers["spec"]["selector"], g["template"]["metadata"]["labels"])
    pdb = one(docs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], g["template"]["metadata"]["labels"])
    assert one(docs, "Pod")["spec"]["containers"][0]["args"][-1] == f"{FULLNAME}-directory:50050"


def test_ray_mode_with_tls_auth_and_monitoring(chart):
    docs = render(chart, {**FULL_VALUES, "mode": "ray", "server": {"threads": 6},
                          "ray": {"enableInTreeAutoscaling": True,
                                  "worker": {"threads": None,
                                             "customResources": {"maskd_cpu_node": 1, "maskd_big": 2}},
                                  "clusterUp": {"workers": 5, "extraArgs": ["--note", "it's quoted"]}}})
    validate_all(docs)
    rc = one(docs, "RayCluster")
    g = rc["spec"]["workerGroupSpecs"][0]
    assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {"maskd_cpu_node": 1, "maskd_big": 2}
    head_spec = rc["spec"]["headGroupSpec"]["template"]["spec"]
    for spec, name in [(g["template"]["spec"], "ray-worker"), (head_spec, "maskd-cluster")]:
        c = container(spec, name)
        assert env_map(c)["MASKD_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "maskd-auth"
        assert any(m["name"] == "tls" for m in c["volumeMounts"])
        assert next(v for v in spec["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "maskd-tls"
    line = next(ln for ln in container(head_spec, "maskd-cluster")["args"][0].splitlines() if "cluster up" in ln)
    words = shlex.split(line)
    assert flag(words, "--workers") == "5"
    assert flag(words, "--threads") == "6"  # ray.worker.threads null: server.threads
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    # KubeRay gives the head its own service account (autoscaler RBAC): the chart must not override it.
    assert "serviceAccountName" not in head_spec and "automountServiceAccountToken" not in head_spec
    assert g["template"]["spec"]["serviceAccountName"] == FULLNAME
    assert flag(words, "--tls-cert").endswith("/tls.crt") and flag(words, "--tls-key").endswith("/tls.key")
    assert words[-2:] == ["--note", "it's quoted"]
    # ServiceMonitor scrapes the worker pods (the maskd actors), not the directory.
    sm = one(docs, "ServiceMonitor")
    workers = one(docs, "Service", f"{FULLNAME}-workers")
    assert sm["spec"]["selector"]["matchLabels"].items() <= workers["metadata"]["labels"].items()
    assert one(docs, "ConfigMap")["metadata"]["labels"]["grafana_dashboard"] == "1"


# --------------------------------------------------------------------------------------------
# invalid values
# --------------------------------------------------------------------------------------------

INVALID_VALUES_FILE = """\
# A values file with the mistakes people make.
mode: kubernetes          # not a mode
server:
  port: "fifty"           # not an integer
  backend: outlines       # not a backend
tls:
  enabled: true           # without secretName
"""


def test_invalid_values_file_fails_schema(chart, tmp_path):
    path = tmp_path / "bad-values.yaml"
    path.write_text(INVALID_VALUES_FILE)
    values = helm.values_from_yaml(path.read_text())
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(err.value)
    for where in ("/mode", "/server/port", "/server/backend", "/tls"):
        assert where in message, message
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


@pytest.mark.parametrize("values, where", [
    ({"replicas": 3}, "replicas"),                                   # typo of replicaCount
    ({"server": {"port": 70000}}, "/server/port"),
    ({"server": {"threads": 0}}, "/server/threads"),
    ({"server": {"logitsWidth": "wide"}}, "/server/logitsWidth"),
    ({"auth": {"enabled": True}}, "/auth"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"probes": {"type": "http"}}, "/probes/type"),
    ({"ray": {"worker": {"customResources": {"maskd_cpu_node": 0}}}}, "/ray/worker/customResources"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
])
def test_invalid_values_fail_schema(chart, values, where):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(err.value)


def test_ray_replica_bounds_are_checked(chart):
    with pytest.raises(helm.HelmRenderError, match="minReplicas"):
        chart.render({"mode": "ray", "ray": {"worker": {"replicas": 1, "minReplicas": 2}}},
                     name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("release, values, named", [
    ("7b", {}, 'a release named "7b" gets the resource name "7b-maskd"'),          # starts with a digit
    ("mk", {"fullnameOverride": "Mask_D"}, 'fullnameOverride "Mask_D"'),          # upper case, underscore
    ("mk", {"nameOverride": "Maskd"}, 'nameOverride "Maskd"'),
    ("mk", {"fullnameOverride": "maskd-"}, None),                                   # trailing '-' is trimmed: fine
    ("mk", {"serviceAccount": {"name": "Maskd SA"}}, 'serviceAccount.name "Maskd SA"'),
])
@pytest.mark.parametrize("mode", ["standalone", "ray"])
def test_names_the_api_server_and_kuberay_refuse_fail_at_render_time(chart, release, values, named, mode):
    values = {**values, "mode": mode}
    if named is None:
        docs = render_as(chart, values, release)
        assert {d["metadata"]["name"] for d in docs if d["kind"] in ("Service", "RayCluster", "Deployment")}
        return
    with pytest.raises(helm.HelmRenderError) as err:
        chart.render(values, name=release, namespace=NAMESPACE)
    message = str(err.value)
    assert named in message and ("DNS-1035" in message or "DNS-1123" in message), message


def render_as(chart, values, release):
    manifests = chart.render(values, name=release, namespace=NAMESPACE)
    return [d for path, text in manifests.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("mutate, where", [
    (lambda rc: rc["spec"]["workerGroupSpecs"][0].update(replica=2), "workerGroupSpecs/0"),          # a typo
    (lambda rc: rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=3),
     "headGroupSpec/template/spec/containers/0/imagePullPolicy"),
    (lambda rc: rc["spec"].update(rayVersion=2.6), "rayVersion"),
    (lambda rc: rc["spec"].update(managedBy="me"), "managedBy"),                                       # CEL rules
])
def test_crd_validation_catches_what_kuberay_would_refuse(chart, mutate, where):
    rc = one(render(chart, {"mode": "ray"}), "RayCluster")
    validate_crd(rc)
    mutate(rc)
    with pytest.raises(CRDValidationError, match=re.escape(where.split("/")[-1])):
        validate_crd(rc)


def test_crd_files_name_their_source():
    readme = (pathlib.Path(__file__).parent / "crds" / "README.md").read_text()
    for (api, kind), file in CRD_FILES.items():
        crd = yaml.safe_load((pathlib.Path(__file__).parent / "crds" / file).read_text())
        assert crd["spec"]["names"]["kind"] == kind
        assert api.split("/")[1] in [v["name"] for v in crd["spec"]["versions"]]
        assert file in readme
    assert "kuberay" in readme and "v1.7.0" in readme and "prometheus-operator" in readme


# --------------------------------------------------------------------------------------------
# shipped example values and generated files
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values_file", sorted(p.name for p in (CHART / "ci").glob("*.yaml")))
def test_ci_values_files_render_valid_objects(chart, values_file):
    values = helm.values_from_yaml((CHART / "ci" / values_file).read_text())
    chart.validate_schema(values)
    docs = render(chart, values)
    validate_all(docs)
    expected = {"RayCluster"} if values.get("mode") == "ray" else {"Deployment"}
    assert expected <= {d["kind"] for d in docs}


@pytest.mark.parametrize("script, shipped", [
    ("gen_dashboard.py", "dashboards/maskd-overview.json"),
    ("gen_schema.py", "values.schema.json"),
])
def test_generated_files_are_in_sync(script, shipped):
    build = runpy.run_path(str(CHART.parent / "tools" / script))["build"]
    assert build() == json.loads((CHART / shipped).read_text()), \
        f"{shipped} is stale: run python helm/tools/{script}"


def test_dashboard_queries_only_metrics_the_server_exports():
    metrics_mod = pytest.importorskip("maskd.server.metrics",
                                      reason="maskd server extras (prometheus-client) not installed")
    exported = set()
    for family in metrics_mod.Metrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        exported.update(family.name + s for s in suffixes)
    dashboard = json.loads((CHART / "dashboards" / "maskd-overview.json").read_text())
    queried = {m for p in dashboard["panels"] for t in p.get("targets", [])
               for m in re.findall(r"\bmaskd_[a-z_]+", t["expr"])}
    assert queried, "the dashboard queries no maskd metric"
    assert queried <= exported, f"the dashboard queries metrics the server does not export: {queried - exported}"


# --------------------------------------------------------------------------------------------
# the rendered command lines against the real maskd CLI (when it is importable)
# --------------------------------------------------------------------------------------------

def _maskd_parser():
    cli = pytest.importorskip("maskd.cli", reason="maskd CLI not importable")
    return cli.build_parser()


def _parse(parser, argv):
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"maskd rejects the chart's command line {argv}") from exc


def test_serve_args_parse_with_the_real_cli(chart):
    parser = _maskd_parser()
    values = {"server": {"port": 7000, "metricsPort": 9100, "tokenizer": "cl100k", "threads": 6,
                         "logitsWidth": 100352, "compileThreads": 3, "maxMessageBytes": 134217728,
                         "maxGrammarBytes": 2097152, "compileTimeoutSeconds": 12.5, "maxStreams": 512,
                         "cacheEntries": 4096, "rowDictSize": 512}}
    args = container(one(render(chart, values), "Deployment")["spec"]["template"]["spec"], "maskd")["args"]
    ns = _parse(parser, args)
    assert ns.command == "serve"
    assert (ns.host, ns.port, ns.metrics_port) == ("0.0.0.0", 7000, 9100)
    assert (ns.tokenizer, ns.backend, ns.threads, ns.logits_width) == ("cl100k", "llguidance", 6, 100352)
    assert (ns.compile_threads, ns.max_message_bytes, ns.max_grammar_bytes) == (3, 134217728, 2097152)
    assert (ns.compile_timeout, ns.max_streams, ns.cache_entries, ns.row_dict_size) == (12.5, 512, 4096, 512)


def test_tls_args_parse_with_the_real_cli(chart):
    parser = _maskd_parser()
    args = container(one(render(chart, FULL_VALUES), "Deployment")["spec"]["template"]["spec"], "maskd")["args"]
    if "--tls-cert" not in parser.format_help() and "--tls-cert" not in _subparser(parser, "serve").format_help():
        pytest.xfail("`maskd serve` has no --tls-cert/--tls-key yet: the chart passes them when tls.enabled")
    ns = _parse(parser, args)
    assert ns.tls_cert.endswith("/tls.crt") and ns.tls_key.endswith("/tls.key")


def _subparser(parser, name):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return None


def test_cluster_up_args_parse_with_the_real_cli(chart):
    parser = _maskd_parser()
    if _subparser(parser, "cluster") is None:
        pytest.skip("`maskd cluster` is not available (maskd_cluster.cli missing or Ray not installed)")
    values = {"mode": "ray", "tls": {"enabled": True, "secretName": "maskd-tls"},
              "server": {"port": 7000, "tokenizer": "cl100k", "rowDictSize": 128}}
    rc = one(render(chart, values), "RayCluster")
    script = container(rc["spec"]["headGroupSpec"]["template"]["spec"], "maskd-cluster")["args"][0]
    line = next(ln for ln in script.splitlines() if "maskd cluster up" in ln)
    words = shlex.split(line)
    ns = _parse(parser, words[2:])  # drop "exec maskd"
    assert ns.command == "cluster" and ns.cluster_command == "up" and ns.address == "auto"
    assert (ns.port, ns.tokenizer, ns.row_dict_size) == (7000, "cl100k", 128)
    assert ns.workers >= 1 and ns.tls_cert.endswith("/tls.crt") and ns.tls_key.endswith("/tls.key")


# Server flags the chart sets itself (not from a `server.*` value), and why.
CHART_OWNED_FLAGS = {
    "--host": "the pod binds 0.0.0.0",
    "--metrics-host": "follows --host",
    "--auth-token-env": "auth.secretName puts the token into MASKD_AUTH_TOKEN, the flag's default variable",
    "--drafts-sync": "only a Ray cluster's workers exchange grammar drafts' counts (with its store actor); "
                     "the chart runs plain servers",
}
# Values outside `server` that render server flags (auth and TLS secrets are mounted).
AUTH_TLS_VALUES = {"auth": {"enabled": True, "tokensSecretName": "maskd-tokens", "allowPlaintext": True},
                   "tls": {"enabled": True, "secretName": "maskd-tls", "clientCAKey": "ca.crt"}}
ALL_SERVER_VALUES = {"port": 7000, "metricsPort": 9100, "tokenizer": "cl100k", "threads": 6, "logitsWidth": 100352,
                     "compileThreads": 3, "maxMessageBytes": 134217728, "maxGrammarBytes": 2097152,
                     "compileTimeoutSeconds": 12.5, "maxStreams": 512, "cacheEntries": 4096, "rowDictSize": 512,
                     "maxTokensPerStep": 8192, "maxDraftTokens": 8, "maxRowsPerStep": 4096,
                     "maxSequencesPerSession": 1000, "maxRowBuffersPerSession": 12, "logLevel": "info",
                     "cacheBytes": 1 << 28,
                     "compileIsolation": "process", "compileNice": 10, "maxStreamsPerTenant": 32, "maxSequences": 20000,
                     "maxSequencesPerTenant": 5000, "maxTokensPerRequest": 100000, "maxGrammarDepth": 64,
                     "maxCompilesQueued": 900, "maxCompilesQueuedPerTenant": 90, "maxCompilesRunningPerTenant": 2,
                     "idleTimeoutSeconds": 120, "slowStepSeconds": 0.05, "drainDelaySeconds": 3,
                     "drainGraceSeconds": 20, "jsonSchemaMode": "strict", "allowHubDownload": True}


def test_server_values_cover_every_server_flag(chart):
    """The chart's server values are checked against ServerConfig: each of its flags has a value (or
    the chart sets it itself, for a stated reason), and the rendered command line gives the config
    those values."""
    config_mod = pytest.importorskip("maskd.server.config", reason="maskd server package not importable")
    parser = _maskd_parser()
    pod = one(render(chart, {"server": ALL_SERVER_VALUES, **AUTH_TLS_VALUES}), "Deployment")["spec"]["template"]["spec"]
    args = container(pod, "maskd")["args"]
    rendered = {a for a in args if a.startswith("--")}
    missing = [f for f in config_mod.flag_names(config_mod.ServerConfig)
               if f not in rendered and f not in CHART_OWNED_FLAGS]
    assert not missing, f"server flags with no chart value: {missing}"
    cfg = config_mod.from_flags(config_mod.ServerConfig, _parse(parser, args))
    lim = cfg.limits
    assert (cfg.port, cfg.metrics_port, cfg.threads, cfg.row_dict_size) == (7000, 9100, 6, 512)
    assert (lim.max_tokens_per_step, lim.max_draft_tokens, lim.max_rows_per_step,
            lim.max_sequences_per_session, lim.compile_timeout_s) == (8192, 8, 4096, 1000, 12.5)
    assert _parse(parser, args).log_level == "info"
    assert (cfg.cache_bytes, cfg.compile_isolation, lim.idle_timeout_s, cfg.drain_delay_s, cfg.drain_grace_s) == (
        1 << 28, "process", 120.0, 3.0, 20.0)
    assert (lim.max_streams_per_tenant, lim.max_sequences, lim.max_compiles_running_per_tenant) == (32, 20000, 2)
    assert lim.max_row_buffers_per_session == 12 and cfg.compile_nice == 10 and lim.slow_step_s == 0.05
    mounts = {m["name"]: m["mountPath"] for m in container(pod, "maskd")["volumeMounts"]}
    assert cfg.auth_tokens_file == mounts["auth-tokens"] + "/tokens" and cfg.allow_plaintext_auth
    assert cfg.tls_client_ca == mounts["tls"] + "/ca.crt"
    assert cfg.json_schema_mode == "strict"
    assert cfg.allow_hub_download is True
    # false renders the negative flag; null (the default) renders nothing
    deployment = one(render(chart, {"server": {"allowHubDownload": False}}), "Deployment")
    off = container(deployment["spec"]["template"]["spec"], "maskd")["args"]
    assert "--no-allow-hub-download" in off and config_mod.from_flags(
        config_mod.ServerConfig, _parse(parser, off)).allow_hub_download is False
    assert not [a for a in container(one(render(chart), "Deployment")["spec"]["template"]["spec"], "maskd")["args"]
                if "hub" in a]


def test_auth_without_tls_fails_at_render_time_unless_plaintext_is_allowed(chart):
    with pytest.raises(Exception, match="in the clear"):
        render(chart, {"auth": {"enabled": True, "secretName": "tok"}})
    args = container(one(render(chart, {"auth": {"enabled": True, "secretName": "tok", "allowPlaintext": True}}),
                         "Deployment")["spec"]["template"]["spec"], "maskd")["args"]
    assert "--allow-plaintext-auth" in args


def test_flag_table_matches_the_schema_and_the_config():
    """server-flags.yaml: each line names a real ServerConfig flag of the right type, once."""
    config_mod = pytest.importorskip("maskd.server.config", reason="maskd server package not importable")
    import dataclasses
    import typing
    rows = yaml.safe_load((CHART / "server-flags.yaml").read_text())
    flags = config_mod.flag_names(config_mod.ServerConfig)
    assert len({r["flag"] for r in rows}) == len(rows) and len({r["value"] for r in rows}) == len(rows)
    fields = {}
    for cls in (config_mod.ServerConfig, config_mod.Limits):
        hints = typing.get_type_hints(cls)
        fields.update({config_mod.flag_name(f): hints[f.name] for f in dataclasses.fields(cls)})
    kinds = {"int": int, "number": float, "string": str, "bool": bool}
    serve_options = {o for a in _subparser(_maskd_parser(), "serve")._actions for o in a.option_strings}
    for row in rows:
        if row["flag"] not in flags:   # a flag every maskd command takes (--log-level)
            assert row["flag"] in serve_options, f"server-flags.yaml: {row['flag']} is no flag of maskd serve"
            continue
        scalar = config_mod._scalar(fields[row["flag"]])[0]
        assert scalar is kinds[row["type"]], f"{row['flag']}: the table says {row['type']}, the config {scalar}"
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["server"]["properties"]
    assert {r["value"] for r in rows} <= set(schema)
