"""Offline checks of deploy/: run by scripts/deploy-check.sh inside .venv-deploy.

Each check prints `ok: ...` or `FAIL: ...`; the exit status is 1 if any failed. Nothing
here talks to a cluster: every kustomization under deploy/ is rendered with `kubectl
kustomize` (the base, the gateway's, the example Secrets, and the overlays, through which
the KEDA component is rendered), built-in kinds are validated against
kubernetes-validate's schemas, the KEDA ScaledObject and the NATS Helm values against the
schemas in deploy/schemas, and the webproxy config in the ConfigMap with the real
`webproxy check-config`, then checked against the Deployment. The HTTP gateway's base
(deploy/kubernetes/gateway) is checked the same way, against its own Deployment, Service
and NetworkPolicy. Secret references are resolved against the example Secrets, the NATS
values against deploy/nats/authorization.conf (which nats-server reads with the example
Secret's passwords), and the metrics the PromQL may name against the ones the code
registers.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kubernetes"
NAMESPACE = "webproxy"
# The optional KEDA autoscaling, a kustomize Component: rendered through an overlay.
KEDA_COMPONENT = KUBE / "components" / "keda"
# Placeholder Secrets with the names and keys the Deployments read.
EXAMPLE_SECRETS = KUBE / "example-secrets"
# Example overlays: kustomize refuses an overlay inside its base's directory.
OVERLAYS = DEPLOY / "overlays"
AUTOSCALED = OVERLAYS / "autoscaled"
GATEWAY_OVERLAY = OVERLAYS / "gateway"
NATS = DEPLOY / "nats"
AUTHORIZATION = NATS / "authorization.conf"
# Where the NATS chart's ConfigMap gets authorization.conf (helm --set-file).
SET_FILE = r"--set-file 'configMap.merge.data.authorization\.conf=deploy/nats/authorization.conf'"
# The HTTP gateway's own base (`webproxy gateway`), rendered and checked on its own.
GATEWAY = KUBE / "gateway"
GATEWAY_KINDS = ["Deployment", "Service", "NetworkPolicy", "ConfigMap"]
GATEWAY_CONTAINER = "webproxy-gateway"
# deploy/nats/authorization.conf's users for the gateway, the service and the operators,
# and its two accounts.
GATEWAY_NATS_USER = "gateway"
SERVICE_NATS_USER = "webproxy"
OPERATOR_NATS_USER = "operator"
SERVICE_ACCOUNT = "WEBPROXY"
CALLERS_ACCOUNT = "CALLERS"
SCHEMAS = DEPLOY / "schemas"

# The oldest Kubernetes the base supports (PodDisruptionBudget's
# unhealthyPodEvictionPolicy is GA from 1.31) and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.31.0", "1.37.0")

# The kinds the base renders, each exactly once; the ones kubernetes-validate knows; and
# where the others' schemas come from.
BASE_KINDS = ["Namespace", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"]
BUILTIN_KINDS = set(BASE_KINDS) | {"Secret"}
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "keda-scaledobject.schema.json"}
# Kinds that live in no namespace.
CLUSTER_SCOPED = {"Namespace"}
# The gauges the autoscaler's query must weigh: waiting work, the pods' attempts in
# flight against the pool's effective limit, and its pause.
SCALING_GAUGES = {"webproxy_pool_waiting", "webproxy_in_flight", "webproxy_pool_effective_limit", "webproxy_pool_paused"}
# Where the code registers its metrics (the dispatcher's under the prefix webproxy_).
METRICS_SOURCES = [
    REPO / "crates" / "webproxy-dispatcher" / "src" / "observability" / "metrics.rs",
    REPO / "crates" / "webproxy" / "src" / "commands" / "gateway" / "metrics.rs",
]
# Paths .dockerignore must keep out of the build context.
DOCKER_IGNORED = [
    "target", ".venv", ".venv-deploy", ".venv-clients", "clients/python/.venv",
    "node_modules", "clients/node/node_modules", "fuzz/target", ".nats",
]

CONTAINER = "webproxy"
CONFIG_KEY = "webproxy.toml"
PROBES = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}

# The metrics the service exports (issue 8), with their labels. The dashboard and the
# PromQL in docs/operations.md may use nothing else.
METRICS = {
    "webproxy_requests_total": {"pool", "rule", "outcome", "code"},
    "webproxy_attempts_total": {"pool", "rule", "result"},
    "webproxy_attempt_duration_seconds": {"pool", "rule"},
    "webproxy_queue_wait_seconds": {"pool"},
    "webproxy_in_flight": {"pool"},
    "webproxy_pool_waiting": {"pool"},
    "webproxy_pool_parked": {"pool"},
    "webproxy_pool_max_in_flight": {"pool"},
    "webproxy_dead_letters_total": {"pool", "code"},
    # Conversations a cancel ended (issue 35), by where it found them: waiting,
    # parked or in_flight.
    "webproxy_conversations_cancelled_total": {"pool", "state"},
    "webproxy_consumer_recreations_total": {"pool"},
    "webproxy_nats_connected": set(),
    "webproxy_config_revision": set(),
    "webproxy_config_refused_total": set(),
    "webproxy_pool_consumer_writes_total": {"pool", "write"},
    "webproxy_pool_consumers_owner": set(),
    "webproxy_pool_paused": {"pool"},
    "webproxy_gate_wait_seconds": {"pool"},
    "webproxy_rate_schedule_requests_total": {"pool"},
    "webproxy_breaker_transitions_total": {"pool", "to"},
    "webproxy_pool_effective_limit": {"pool"},
    "webproxy_clock_skew_seconds": set(),
    "webproxy_state_bucket_bytes": {"bucket"},
    "webproxy_state_bucket_used_ratio": {"bucket"},
    # Each pool's body store for large bodies (issue 34).
    "webproxy_body_store_used_ratio": {"pool"},
    "webproxy_dns_lookup_failures_total": {"reason"},
    "webproxy_build_info": {"version"},
    # `webproxy gateway` (issue 21), on its own health listener.
    "webproxy_gateway_requests_total": {"route", "outcome"},
    "webproxy_gateway_wait_seconds": {"route"},
    "webproxy_gateway_waiting": set(),
    "webproxy_gateway_refused_connections_total": set(),
    "webproxy_gateway_nats_connected": set(),
    # The gateway's limits on what one client can hold (issue 30).
    "webproxy_gateway_connections": set(),
    "webproxy_gateway_connections_opened_total": set(),
    "webproxy_gateway_limits_total": {"limit"},
    "webproxy_gateway_accept_errors_total": set(),
}
HISTOGRAMS = {
    "webproxy_attempt_duration_seconds",
    "webproxy_queue_wait_seconds",
    "webproxy_gate_wait_seconds",
    "webproxy_gateway_wait_seconds",
}
# Gauges every pod reports with the same cluster-wide value: summing them over pods
# multiplies the value by the replica count.
CLUSTER_WIDE = {
    "webproxy_pool_waiting",
    "webproxy_pool_parked",
    "webproxy_pool_max_in_flight",
    "webproxy_pool_paused",
    "webproxy_pool_effective_limit",
    "webproxy_state_bucket_bytes",
    "webproxy_state_bucket_used_ratio",
    "webproxy_body_store_used_ratio",
}
# An aggregation up to the opening bracket of its argument: `max by (pool) (`.
AGGREGATION = r"\b([a-z_]+)\s*(?:(?:by|without)\s*\([^)]*\)\s*)?\(\s*$"
# The callers' own mistakes, which error ratios and alerts leave out.
CALLER_MISTAKES = 'code!~"denied|invalid_request"'
# A Kubernetes resource quantity: 128Mi, 100m, 1.5, 2e3.
QUANTITY = r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?"
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job", "pod", "namespace"}


class Report:
    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.passed = 0
        self.failures = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        if ok:
            self.passed += 1
            if self.verbose:
                print(f"ok: {what}")
        else:
            self.failures += 1
            print(f"FAIL: {what}{': ' + detail if detail else ''}")
        return ok


def load_yaml_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def render(kubectl: str, report: Report, base: Path = KUBE) -> list[dict]:
    result = subprocess.run(
        [kubectl, "kustomize", str(base)], capture_output=True, text=True, check=False
    )
    if not report.check(result.returncode == 0, f"kustomize renders {base.relative_to(REPO)}", result.stderr.strip()):
        return []
    return load_yaml_docs(result.stdout)


def check_kustomization_lists_every_file(report: Report, base: Path = KUBE) -> None:
    """A manifest left out of kustomization.yaml would never be applied or validated."""
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    listed = {r for r in kustomization.get("resources", []) if (base / r).is_file()}
    for generator in kustomization.get("configMapGenerator", []) + kustomization.get("secretGenerator", []):
        listed.update(f.split("=", 1)[-1] for f in generator.get("files", []))
    present = {p.name for p in base.iterdir() if p.is_file() and p.name != "kustomization.yaml"}
    report.check(
        listed == present,
        f"kustomization.yaml lists exactly the files in {base.relative_to(REPO)}",
        f"not listed: {sorted(present - listed)}, missing: {sorted(listed - present)}",
    )


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def schema_errors(schema_path: Path, instance: object) -> list[str]:
    schema = json.loads(schema_path.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft202012Validator(schema).iter_errors(instance)
    ]


def check_schemas(docs: list[dict], report: Report, expected: list[str], base: str, namespace: str = NAMESPACE) -> None:
    kinds = [d.get("kind") for d in docs]
    report.check(
        sorted(map(str, kinds)) == sorted(expected),
        f"{base} renders exactly the expected objects ({', '.join(sorted(expected))})",
        f"rendered {sorted(map(str, kinds))}, expected {sorted(expected)}",
    )
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        actual = doc.get("metadata", {}).get("namespace")
        wanted = None if doc.get("kind") in CLUSTER_SCOPED else namespace
        report.check(actual == wanted, f"{base}: {name} is in namespace {wanted or '(none: cluster-scoped)'}", f"it is in {actual}")
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        crd_schema = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
        if crd_schema is not None:
            errors = schema_errors(crd_schema, doc)
            report.check(not errors, f"{name} matches {crd_schema.relative_to(REPO)}", "; ".join(errors))
        elif doc.get("kind") in BUILTIN_KINDS:
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                    report.check(True, f"{name} is valid for Kubernetes {version} (strict)")
                except kubernetes_validate.ValidationError as e:
                    path = ".".join(map(str, e.path))
                    report.check(False, f"{name} is valid for Kubernetes {version} (strict)", f"{path}: {e.message}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    report.check(False, f"{name} has a Kubernetes {version} schema", e.message)
        else:
            report.check(False, f"{name} has a schema to validate it against", "unknown kind")


def check_nats_values(report: Report) -> dict:
    path = DEPLOY / "nats" / "values.yaml"
    values = yaml.safe_load(path.read_text())
    errors = schema_errors(SCHEMAS / "nats-values.schema.json", values)
    report.check(not errors, "deploy/nats/values.yaml matches deploy/schemas/nats-values.schema.json", "; ".join(errors))
    return values


# humantime's units, as the service parses durations.
DURATION_UNITS = {
    **dict.fromkeys(("ms", "msec", "millis"), 0.001),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
}


def seconds(duration: str) -> float:
    """A humantime duration such as "30s" or "1m 30s", in seconds."""
    parts = re.findall(r"(\d+)\s*([a-z]+)", duration)
    if not parts or re.sub(r"(\d+)\s*([a-z]+)|\s", "", duration) or any(u not in DURATION_UNITS for _, u in parts):
        raise ValueError(f"cannot read duration {duration!r}")
    return sum(int(n) * DURATION_UNITS[unit] for n, unit in parts)


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def effective_config(text: str) -> dict:
    """The file over the compiled-in defaults, as the service layers them (environment
    variables aside: the pod sets none)."""
    return merged(tomllib.loads((REPO / "config" / "default.toml").read_text()), tomllib.loads(text))


def check_config(webproxy: str, label: str, text: str, report: Report, secrets: dict[str, str] | None = None,
                 gateway: bool = False) -> dict | None:
    """Runs the real `webproxy check-config --json` on the text, with `secrets` (the
    variables the pod gets from Secrets, placeholders here) in the environment; with
    `gateway`, `--gateway`: what `webproxy gateway` checks (its routes' tokens) rather
    than `serve`."""
    # WEBPROXY_ variables and the nats CLI's (NATS_URL, NATS_CREDS, NATS_CONTEXT) are
    # configuration too; a developer's own must not leak in.
    nats_cli = ("NATS_URL", "NATS_CREDS", "NATS_CONTEXT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEBPROXY_") and k not in nats_cli}
    env.update(secrets or {})
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        result = subprocess.run(
            [webproxy, "check-config", "--config", f.name, "--json", *(["--gateway"] if gateway else [])],
            capture_output=True, text=True, env=env, check=False,
        )
    if not report.check(result.returncode == 0, f"webproxy check-config accepts {label}", result.stderr.strip()):
        return None
    return json.loads(result.stdout)


def host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def container_port(container: dict, port: int | str) -> int | None:
    """A numeric port, or the number of the container port with that name."""
    if isinstance(port, int):
        return port
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == port), None)


def selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels", {})
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def dockerfile_facts() -> tuple[list[str], set[int], str | None]:
    """The final ENTRYPOINT, the EXPOSEd ports and the last USER of deploy/Dockerfile."""
    text = (DEPLOY / "Dockerfile").read_text()
    entrypoints = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    exposed = {int(p) for line in re.findall(r"^EXPOSE\s+(.+)$", text, re.M) for p in re.findall(r"\d+", line)}
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    return (json.loads(entrypoints[-1]) if entrypoints else []), exposed, (users[-1] if users else None)


def check_listen(label: str, config: dict, exposed: set[int], report: Report) -> int:
    """http.listen must be reachable from outside the container, on the EXPOSEd port."""
    listen = config["http"]["listen"]
    host, port = host_port(listen)
    report.check(
        host not in ("127.0.0.1", "localhost", "::1"),
        f"{label}: http.listen is reachable from outside the container",
        f"{listen} is loopback: kubelet probes and Prometheus cannot reach it",
    )
    report.check(port in exposed, f"{label}: the Dockerfile EXPOSEs port {port}", f"it exposes {sorted(exposed)}")
    return port


def check_deployment_agrees(
    docs: list[dict], nats_values: dict, secrets: dict[str, dict[str, str]], nats_passwords: dict[str, str], webproxy: str, report: Report
) -> None:
    """The ConfigMap's config is valid, in the pod's environment, and agrees with the
    Deployment, the image, the Secrets and the other resources."""
    kinds = by_kind(docs)
    deployment, configmap = kinds.get("Deployment"), kinds.get("ConfigMap")
    if not (deployment and configmap):
        report.check(False, "the base has a Deployment and a ConfigMap to compare")
        return
    text = configmap.get("data", {}).get(CONFIG_KEY)
    if not report.check(text is not None, f"the ConfigMap has {CONFIG_KEY}"):
        return
    config = effective_config(text)
    spec = deployment["spec"]["template"]["spec"]
    container = next((c for c in spec["containers"] if c["name"] == CONTAINER), None)
    if not report.check(container is not None, f"the Deployment has a container named {CONTAINER}"):
        return
    env = pod_environment("the Deployment", container, secrets, report)
    check_nats_user("the service", env, SERVICE_NATS_USER, nats_passwords, report)
    check_service_stream_rights(config, report)
    check_cancel_rights(config, report)
    check_volumes("the Deployment", spec, configmap, secrets, report)
    checked = check_config(webproxy, "the ConfigMap's webproxy.toml", text, report, env)

    entrypoint, exposed, image_user = dockerfile_facts()
    port = check_listen("the ConfigMap's webproxy.toml", config, exposed, report)
    check_ports_and_probes(container, port, kinds.get("Service", {}), report)
    check_shutdown(spec, config, report)
    check_config_mount(spec, container, configmap, entrypoint, report)
    check_pod_security(spec, container, image_user, report)
    check_selectors(kinds, report)
    check_network_policy(kinds.get("NetworkPolicy", {}), port, config, report)
    if checked is not None:
        check_streams_fit_nats(checked, nats_values, report)


def check_ports_and_probes(container: dict, port: int, service: dict, report: Report) -> None:
    http_port = container_port(container, "http")
    report.check(http_port == port, "the container port `http` is http.listen's port", f"{http_port} != {port}")
    for probe, path in PROBES.items():
        get = container.get(probe, {}).get("httpGet", {})
        report.check(get.get("path") == path, f"{probe} asks {path}", f"it asks {get.get('path')}")
        report.check(
            container_port(container, get.get("port")) == port,
            f"{probe} probes http.listen's port {port}",
            f"it probes {get.get('port')}",
        )
    service_ports = service.get("spec", {}).get("ports", [])
    report.check(
        any(container_port(container, p.get("targetPort", p.get("port"))) == port for p in service_ports),
        f"the Service forwards to port {port}",
        f"ports: {service_ports}",
    )


def check_shutdown(spec: dict, config: dict, report: Report) -> None:
    try:
        grace = seconds(config["service"]["shutdown_grace"])
    except ValueError as e:
        report.check(False, "service.shutdown_grace is readable", str(e))
        return
    termination = spec.get("terminationGracePeriodSeconds", 30)
    report.check(
        termination > grace,
        f"terminationGracePeriodSeconds ({termination}) is above service.shutdown_grace ({grace:g}s)",
        "Kubernetes would SIGKILL attempts still inside their grace",
    )
    report.check(
        spec.get("enableServiceLinks") is False,
        "enableServiceLinks is false",
        "a Service named webproxy injects WEBPROXY_* variables, which the service warns about at every start",
    )


def check_config_mount(spec: dict, container: dict, configmap: dict, entrypoint: list[str], report: Report) -> None:
    """The image's entrypoint reads its config where the ConfigMap is mounted."""
    config_path = entrypoint[entrypoint.index("--config") + 1] if "--config" in entrypoint else None
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounted = {
        f"{m['mountPath'].rstrip('/')}/{CONFIG_KEY}": volumes.get(m["name"], {}).get("configMap", {}).get("name")
        for m in container.get("volumeMounts", [])
    }
    report.check(
        mounted.get(config_path) == configmap["metadata"]["name"],
        f"the ConfigMap is mounted where the image's entrypoint reads its config ({config_path})",
        f"mounts: {mounted}",
    )


def check_pod_security(spec: dict, container: dict, image_user: str | None, report: Report) -> None:
    pod, own = spec.get("securityContext", {}), container.get("securityContext", {})

    def setting(key: str) -> object:
        return own.get(key, pod.get(key))

    restricted = {
        "runAsNonRoot": setting("runAsNonRoot") is True,
        "readOnlyRootFilesystem": own.get("readOnlyRootFilesystem") is True,
        "allowPrivilegeEscalation false": own.get("allowPrivilegeEscalation") is False,
        "capabilities drop ALL": own.get("capabilities", {}).get("drop") == ["ALL"],
        "seccompProfile RuntimeDefault": (setting("seccompProfile") or {}).get("type") == "RuntimeDefault",
    }
    report.check(all(restricted.values()), "the container runs restricted", f"missing: {[k for k, v in restricted.items() if not v]}")
    # runAsNonRoot can verify only a numeric image user; the pod's must be the same one.
    run_as = f"{setting('runAsUser')}:{setting('runAsGroup')}"
    report.check(
        image_user is not None and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", image_user) is not None and image_user == run_as,
        f"the image's USER is the pod's non-root runAsUser:runAsGroup ({run_as})",
        f"the Dockerfile's last USER is {image_user}",
    )
    # kubernetes-validate's schemas leave quantities unchecked; the API server does not.
    quantities = {
        f"{kind}.{resource}": value
        for kind, resources in container.get("resources", {}).items()
        for resource, value in resources.items()
    }
    bad = {k: v for k, v in quantities.items() if not re.fullmatch(QUANTITY, str(v))}
    report.check(bool(quantities) and not bad, "the container's resources are valid quantities", f"{bad or 'none set'}")


def check_selectors(kinds: dict, report: Report) -> None:
    """A selector that misses the pods fails silently: no endpoints, no budget, no policy."""
    deployment = kinds["Deployment"]
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    for kind, selector in (
        ("Deployment", deployment["spec"]["selector"]),
        ("Service", kinds.get("Service", {}).get("spec", {}).get("selector", {})),
        ("PodDisruptionBudget", kinds.get("PodDisruptionBudget", {}).get("spec", {}).get("selector", {})),
        ("NetworkPolicy", kinds.get("NetworkPolicy", {}).get("spec", {}).get("podSelector", {})),
    ):
        # A Service's selector is a plain map; the others are label selectors.
        selector = selector if "matchLabels" in selector else {"matchLabels": selector}
        report.check(selects(selector, labels), f"the {kind} selects the webproxy pods", f"{selector} vs {labels}")


def check_network_policy(policy: dict, port: int, config: dict, report: Report) -> None:
    spec = policy.get("spec", {})
    ingress_ports = {p.get("port") for rule in spec.get("ingress", []) for p in rule.get("ports", [])}
    report.check(ingress_ports == {port}, f"the NetworkPolicy admits port {port} alone", f"it admits {ingress_ports}")
    check_nats_egress("the NetworkPolicy", spec, config, report)
    blocks = [peer["ipBlock"] for rule in spec.get("egress", []) for peer in rule.get("to", []) if "ipBlock" in peer]
    private = {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16"}
    report.check(
        all(private <= set(b.get("except", [])) for b in blocks) and bool(blocks),
        "the NetworkPolicy's internet egress excludes every private and link-local range",
        f"ipBlocks: {blocks}",
    )


def check_nats_egress(label: str, spec: dict, config: dict, report: Report) -> None:
    nats = urlsplit(config["nats"]["url"].split(",")[0])
    nats_namespace = nats.hostname.split(".")[1] if nats.hostname and "." in nats.hostname else None
    allowed = [
        rule
        for rule in spec.get("egress", [])
        if any(p.get("port") == nats.port for p in rule.get("ports", []))
        and any(
            peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name") == nats_namespace
            for peer in rule.get("to", [])
        )
    ]
    report.check(
        bool(allowed),
        f"{label} lets its pods reach NATS at namespace {nats_namespace}, port {nats.port}",
        f"nats.url = {config['nats']['url']}",
    )


def secret_variables(config: dict) -> set[str]:
    """The environment variables the gateway's tokens and key are read from."""
    gateway = config.get("gateway", {})
    sources = [route.get("token") for route in gateway.get("routes", [])] + [gateway.get("key")]
    return {source["env"] for source in sources if isinstance(source, dict) and "env" in source}


def user_block(user: str) -> str:
    """authorization.conf's block of `user`, without comments, up to the next user."""
    text = authorization_text()
    start = text.find(f"user: {user}\n")
    if start < 0:
        return ""
    end = text.find("user:", start + 1)
    return text[start:] if end < 0 else text[start:end]


def publish_permissions(user: str) -> tuple[list[str], list[str]]:
    """The subjects `user` may publish to (allow) and may not (deny) in
    authorization.conf."""
    block = user_block(user)
    publish = re.search(r"publish:\s*\{(.*?)\}", block, re.S)
    body = publish.group(1) if publish else ""
    lists = {kind: re.search(rf"{kind}:\s*\[(.*?)\]", body, re.S) for kind in ("allow", "deny")}
    allow, deny = (re.findall(r'"([^"]+)"', m.group(1)) if m else [] for m in lists.values())
    return allow, deny


def subscribe_permissions(user: str) -> tuple[list[str], list[str]]:
    """The subjects `user` may subscribe to (allow) and may not (deny) in
    authorization.conf."""
    block = user_block(user)
    subscribe = re.search(r"subscribe:\s*\{(.*?)\}", block, re.S)
    body = subscribe.group(1) if subscribe else ""
    lists = {kind: re.search(rf"{kind}:\s*\[(.*?)\]", body, re.S) for kind in ("allow", "deny")}
    allow, deny = (re.findall(r'"([^"]+)"', m.group(1)) if m else [] for m in lists.values())
    return allow, deny


def unrestricted(user: str) -> bool:
    """Whether authorization.conf gives `user` no permissions block: it may then publish
    and subscribe to anything in its account."""
    return "permissions:" not in user_block(user)


def may_subscribe(user: str, subject: str) -> bool:
    """Whether authorization.conf lets `user` subscribe to `subject` (a deny wins)."""
    if unrestricted(user):
        return True
    allow, deny = subscribe_permissions(user)
    return any(subject_matches(p, subject) for p in allow) and not any(subject_matches(p, subject) for p in deny)


def answers_imported_requests(user: str) -> bool:
    """Whether `user` may answer requests it received whatever their reply subject
    (`allow_responses`): the only way to answer a request imported from another
    account, whose reply subject the server makes up."""
    return re.search(r"\ballow_responses:\s*true\b", user_block(user)) is not None


def account_block(account: str) -> str:
    """authorization.conf's block of `account`, without comments, up to the next
    account (accounts open two spaces in, `NAME: {`)."""
    text = authorization_text()
    starts = [(m.group(1), m.start()) for m in re.finditer(r"^  ([A-Z][A-Z0-9_]*):\s*\{", text, re.M)]
    for i, (name, start) in enumerate(starts):
        if name == account:
            return text[start : starts[i + 1][1]] if i + 1 < len(starts) else text[start:]
    return ""


def account_users(account: str) -> set[str]:
    """The users of `account` in authorization.conf."""
    return set(re.findall(r"\buser:\s*([A-Za-z0-9_-]+)", account_block(account)))


def account_imports(account: str) -> list[tuple[str, str, str]]:
    """What `account` imports: (service or stream, from which account, subject)."""
    return re.findall(
        r"\{\s*(service|stream):\s*\{\s*account:\s*([A-Za-z0-9_]+)\s*,\s*subject:\s*\"([^\"]+)\"", account_block(account)
    )


def account_exports(account: str) -> list[tuple[str, str, set[str]]]:
    """What `account` exports: (service or stream, subject, the accounts it may go to)."""
    found = re.findall(
        r"\{\s*(service|stream):\s*\"([^\"]+)\"\s*,\s*accounts:\s*\[([^\]]*)\]", account_block(account)
    )
    return [(kind, subject, set(re.findall(r"[A-Za-z0-9_]+", accounts))) for kind, subject, accounts in found]


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subject pattern matches a subject, token by token: `*` is one
    whole token, `>` the rest."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or (token != "*" and token != tokens[i]):
            return False
    return len(tokens) == len(wanted)


def may_publish(user: str, subject: str) -> bool:
    """Whether authorization.conf lets `user` publish on `subject`: an allow matches
    and no deny does (a deny wins)."""
    allow, deny = publish_permissions(user)
    return any(subject_matches(p, subject) for p in allow) and not any(subject_matches(p, subject) for p in deny)


def gateway_request_subjects() -> set[str]:
    """The request subjects authorization.conf's gateway user may publish to."""
    allow, _ = publish_permissions(GATEWAY_NATS_USER)
    return {subject for subject in allow if subject.startswith("webproxy.request.")}


def stream_names(config: dict) -> dict[str, str | set[str]]:
    """The names of the streams a config's service and gateway keep (subjects.rs):
    its prefix's stream prefix, its pools' streams, their replies and dead-letter
    streams (layout 3) and fences, and the buckets' streams of the service and of the
    gateway."""
    upper = config.get("streams", {}).get("prefix", "webproxy").replace(".", "_").upper()
    pools = {pool.upper() for pool in config.get("pools", {})}
    return {
        "prefix": upper,
        "pools": {f"{upper}_POOL_{pool}" for pool in pools},
        "pool_replies": {f"{upper}_POOL_{pool}_REPLIES" for pool in pools},
        "pool_dead": {f"{upper}_POOL_{pool}_DEAD" for pool in pools},
        "fences": {f"{upper}_FENCE_REPLIES"} | {f"{upper}_FENCE_POOL_{pool}" for pool in pools},
        "service_buckets": {f"KV_{upper}_{b}" for b in ("PROGRESS", "CONFIG", "INSTANCES", "POOL_STATE", "RATE", "CANCELS")},
        "gateway_buckets": {f"KV_{upper}_{b}" for b in ("GATEWAY", "GATEWAY_KEY")},
    }


def check_service_stream_rights(config: dict, report: Report) -> None:
    """The service user may delete exactly its config's fences (to move a memory
    fence onto file), and no other stream; it may read, make and update its buckets'
    streams (the "not found" check, bounds, per-message TTLs); it may purge none."""
    names = stream_names(config)
    allow, _ = publish_permissions(SERVICE_NATS_USER)
    deletes = {s.removeprefix("$JS.API.STREAM.DELETE.") for s in allow if s.startswith("$JS.API.STREAM.DELETE.")}
    report.check(
        deletes == names["fences"],
        "authorization.conf's service user may delete exactly the fences of its config's pools and replies",
        f"fences: {sorted(names['fences'])}; deletes allowed: {sorted(deletes)}",
    )
    others = sorted(names["pools"] | names["pool_replies"] | names["pool_dead"] | names["service_buckets"] | names["gateway_buckets"]) + [
        f"{names['prefix']}_REPLIES",
        f"{names['prefix']}_DEAD",
    ]
    deletable = [n for n in others if may_publish(SERVICE_NATS_USER, f"$JS.API.STREAM.DELETE.{n}")]
    report.check(not deletable, "authorization.conf's service user may delete no stream but its fences", f"deletable: {deletable}")
    purgeable = [n for n in others if may_publish(SERVICE_NATS_USER, f"$JS.API.STREAM.PURGE.{n}")]
    report.check(not purgeable, "authorization.conf's service user may purge no stream", f"purgeable: {purgeable}")
    for verb in ("INFO", "CREATE", "UPDATE"):
        missing = sorted(
            n for n in names["service_buckets"] | names["fences"] if not may_publish(SERVICE_NATS_USER, f"$JS.API.STREAM.{verb}.{n}")
        )
        report.check(not missing, f"authorization.conf's service user may STREAM.{verb} its buckets and fences", f"missing: {missing}")


def check_cancel_rights(config: dict, report: Report) -> None:
    """Who may send and answer cancels (issue 35). A caller's cancel carries the
    message id it published with, its capability; an operator's, on admin.cancel, the
    origin alone, so the subject is the only check (core NATS carries no sender
    identity). The callers' account imports `<prefix>.cancel` alone, as a service
    (one answer per request), and nothing that reaches admin.cancel; every caller may
    publish the first and is refused the second; the gateway (its DELETE) publishes
    cancel; in webproxy's account only the operator user may publish admin.cancel; the
    service alone subscribes to either, in any account (a subscriber would read the
    callers' message ids), and answers requests from the callers' account
    (`allow_responses`)."""
    prefix = config.get("streams", {}).get("prefix", "webproxy")
    cancel, admin_cancel = f"{prefix}.cancel", f"{prefix}.admin.cancel"
    imports = account_imports(CALLERS_ACCOUNT)
    reaching = sorted(f"{kind} {subject}" for kind, source, subject in imports if subject_matches(subject, cancel))
    report.check(
        reaching == [f"service {cancel}"]
        and (("service", SERVICE_ACCOUNT, cancel) in imports),
        f"authorization.conf's {CALLERS_ACCOUNT} imports {cancel} alone, as a service of {SERVICE_ACCOUNT}",
        f"imports that reach it: {reaching}",
    )
    exports = account_exports(SERVICE_ACCOUNT)
    report.check(
        any(kind == "service" and subject == cancel and CALLERS_ACCOUNT in accounts for kind, subject, accounts in exports),
        f"authorization.conf's {SERVICE_ACCOUNT} exports {cancel} to {CALLERS_ACCOUNT} as a service",
        f"exports: {exports}",
    )
    leaks = sorted(
        {f"import {subject}" for _, _, subject in imports if subject_matches(subject, admin_cancel)}
        | {f"export {subject}" for _, subject, _ in exports if subject_matches(subject, admin_cancel)}
    )
    report.check(not leaks, f"authorization.conf neither exports nor imports {admin_cancel}", f"{leaks}")
    callers = sorted(account_users(CALLERS_ACCOUNT))
    report.check(bool(callers), f"authorization.conf's {CALLERS_ACCOUNT} has caller users")
    unable = [user for user in callers if unrestricted(user) or not may_publish(user, cancel)]
    report.check(not unable, f"every caller user may publish {cancel}", f"unable: {unable}")
    able = [user for user in callers if unrestricted(user) or may_publish(user, admin_cancel)]
    report.check(not able, f"no caller user may publish {admin_cancel}", f"able: {able}")
    report.check(
        may_publish(GATEWAY_NATS_USER, cancel),
        f"authorization.conf's gateway user may publish {cancel} (its DELETE /_webproxy/replies/<id>)",
    )
    operators = sorted(user for user in account_users(SERVICE_ACCOUNT) if unrestricted(user) or may_publish(user, admin_cancel))
    report.check(
        operators == [OPERATOR_NATS_USER],
        f"in {SERVICE_ACCOUNT}, exactly authorization.conf's operator user may publish {admin_cancel}",
        f"able: {operators}",
    )
    users = account_users(SERVICE_ACCOUNT) | account_users(CALLERS_ACCOUNT)
    for subject in (cancel, admin_cancel):
        subscribers = sorted(user for user in users if may_subscribe(user, subject))
        report.check(
            subscribers == [SERVICE_NATS_USER],
            f"exactly authorization.conf's service user may subscribe to {subject}",
            f"subscribers: {subscribers}",
        )
    report.check(
        answers_imported_requests(SERVICE_NATS_USER),
        "authorization.conf's service user answers requests imported from the callers' account (allow_responses)",
    )


def check_gateway_stream_rights(config: dict, report: Report) -> None:
    """The gateway user may read the info of (the "not found" check), create and update
    (a lost records bucket made again, each brought to its declared bound) exactly its
    two buckets' streams, and no other stream."""
    names = stream_names(config)
    allow, _ = publish_permissions(GATEWAY_NATS_USER)
    for verb in ("INFO", "CREATE", "UPDATE"):
        prefix = f"$JS.API.STREAM.{verb}."
        allowed = {s.removeprefix(prefix) for s in allow if s.startswith(prefix)}
        report.check(
            allowed == names["gateway_buckets"] and not any(subject_matches(p, f"{prefix}KV_OTHER") for p in allow),
            f"authorization.conf's gateway user may STREAM.{verb} exactly its buckets' streams",
            f"buckets: {sorted(names['gateway_buckets'])}; allowed: {sorted(allowed)}",
        )


def check_gateway_pools(config: dict, report: Report) -> None:
    """The gateway user may publish to exactly the pools the gateway's routes name, so
    a route to a new pool fails here until authorization.conf allows that pool."""
    pools = {route.get("pool", "default") for route in config.get("gateway", {}).get("routes", [])}
    wanted = {f"webproxy.request.{pool}" for pool in pools}
    allowed = gateway_request_subjects()
    report.check(
        allowed == wanted,
        "authorization.conf's gateway user may publish requests to exactly its routes' pools",
        f"routes' pools: {sorted(wanted)}; allowed: {sorted(allowed)}",
    )


def check_gateway_bodies(config: dict, report: Report) -> None:
    """The gateway user may upload request bodies (body.put) to exactly the pools of
    its `large_bodies` routes, and ask for stored bodies (body.get) exactly when it has
    such a route: a route that opts in fails here until authorization.conf agrees."""
    routes = config.get("gateway", {}).get("routes", [])
    large = {route.get("pool", "default") for route in routes if route.get("large_bodies")}
    allow, _ = publish_permissions(GATEWAY_NATS_USER)
    puts = {s.removeprefix("webproxy.body.put.") for s in allow if s.startswith("webproxy.body.put.")}
    report.check(
        puts == large and not may_publish(GATEWAY_NATS_USER, "webproxy.body.put.other"),
        "authorization.conf's gateway user may upload bodies to exactly its large_bodies routes' pools",
        f"large_bodies routes' pools: {sorted(large)}; body.put allowed: {sorted(puts)}",
    )
    report.check(
        may_publish(GATEWAY_NATS_USER, "webproxy.body.get") == bool(large),
        "authorization.conf's gateway user may ask for stored bodies exactly when a route has large_bodies",
        f"large_bodies routes' pools: {sorted(large)}",
    )


def check_gateway_reply_reads(config: dict, report: Report) -> None:
    """The gateway user may read stored replies (STREAM.MSG.GET) from exactly the
    replies streams of the pools its routes name, and from the shared replies stream
    that layout 3 retired (replies stored before the upgrade), and from no other
    stream: a route to a new pool fails here until its replies stream is allowed."""
    upper = config.get("streams", {}).get("prefix", "webproxy").replace(".", "_").upper()
    pools = {route.get("pool", "default").upper() for route in config.get("gateway", {}).get("routes", [])}
    wanted = {f"{upper}_POOL_{pool}_REPLIES" for pool in pools} | {f"{upper}_REPLIES"}
    allow, _ = publish_permissions(GATEWAY_NATS_USER)
    prefix = "$JS.API.STREAM.MSG.GET."
    allowed = {s.removeprefix(prefix) for s in allow if s.startswith(prefix)}
    report.check(
        allowed == wanted and not any(subject_matches(p, f"{prefix}OTHER") for p in allow),
        "authorization.conf's gateway user may read stored replies from exactly its routes' pools' replies streams and the retired shared one",
        f"wanted: {sorted(wanted)}; allowed: {sorted(allowed)}",
    )


def check_gateway(
    kubectl: str, webproxy: str, service_docs: list[dict], secrets: dict[str, dict[str, str]], nats_passwords: dict[str, str], report: Report
) -> list[dict]:
    """deploy/kubernetes/gateway: its own Deployment, Service and NetworkPolicy, whose
    config is valid and agrees with them, apart from the service's pods."""
    check_kustomization_lists_every_file(report, GATEWAY)
    docs = render(kubectl, report, GATEWAY)
    if not docs:
        return []
    check_schemas(docs, report, GATEWAY_KINDS, "the gateway base")
    kinds = by_kind(docs)
    deployment, configmap = kinds.get("Deployment"), kinds.get("ConfigMap")
    if not report.check(bool(deployment and configmap), "the gateway base has a Deployment and a ConfigMap"):
        return docs
    text = configmap.get("data", {}).get(CONFIG_KEY, "")
    config = effective_config(text)
    spec = deployment["spec"]["template"]["spec"]
    container = next((c for c in spec["containers"] if c["name"] == GATEWAY_CONTAINER), None)
    if not report.check(container is not None, f"the gateway Deployment has a container named {GATEWAY_CONTAINER}"):
        return docs
    env = pod_environment("the gateway's Deployment", container, secrets, report)
    wanted = secret_variables(config)
    report.check(
        wanted <= set(env),
        "the gateway's container sets every variable its tokens and key are read from",
        f"missing: {sorted(wanted - set(env))}",
    )
    check_config(webproxy, "the gateway's webproxy.toml", text, report, env, gateway=True)
    check_nats_user("the gateway", env, GATEWAY_NATS_USER, nats_passwords, report)
    check_volumes("the gateway's Deployment", spec, configmap, secrets, report)
    check_gateway_pools(config, report)
    check_gateway_reply_reads(config, report)
    check_gateway_bodies(config, report)
    check_gateway_stream_rights(config, report)
    command = container.get("command", [])
    report.check(
        command[1:3] == ["gateway", "--config"],
        "the gateway's container runs `webproxy gateway --config ...`",
        f"command: {command}",
    )
    check_config_mount(spec, container, configmap, command, report)
    check_pod_security(spec, container, dockerfile_facts()[2], report)
    check_shutdown(spec, config, report)

    listen, health = (host_port(config["gateway"][key]) for key in ("listen", "health_listen"))
    for key, (host, port), name in (("listen", listen, "http"), ("health_listen", health, "health")):
        report.check(
            host not in ("127.0.0.1", "localhost", "::1"),
            f"gateway.{key} is reachable from outside the container",
            f"{host} is loopback",
        )
        report.check(
            container_port(container, name) == port,
            f"the gateway's container port `{name}` is gateway.{key}'s port {port}",
            f"{container_port(container, name)} != {port}",
        )
    for probe, path in PROBES.items():
        get = container.get(probe, {}).get("httpGet", {})
        report.check(
            get.get("path") == path and container_port(container, get.get("port")) == health[1],
            f"the gateway's {probe} asks {path} on gateway.health_listen",
            f"it asks {get.get('path')} on {get.get('port')}",
        )
    service = kinds.get("Service", {}).get("spec", {})
    report.check(
        any(container_port(container, p.get("targetPort", p.get("port"))) == listen[1] for p in service.get("ports", [])),
        f"the gateway's Service forwards to gateway.listen's port {listen[1]}",
        f"ports: {service.get('ports')}",
    )
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    policy = kinds.get("NetworkPolicy", {}).get("spec", {})
    for kind, selector in (
        ("Deployment", deployment["spec"]["selector"]),
        ("Service", {"matchLabels": service.get("selector", {})}),
        ("NetworkPolicy", policy.get("podSelector", {})),
    ):
        report.check(selects(selector, labels), f"the gateway's {kind} selects the gateway pods", f"{selector} vs {labels}")
    service_kinds = by_kind(service_docs)
    for kind, selector in (
        ("Service", {"matchLabels": service_kinds.get("Service", {}).get("spec", {}).get("selector", {})}),
        ("NetworkPolicy", service_kinds.get("NetworkPolicy", {}).get("spec", {}).get("podSelector", {})),
        ("PodDisruptionBudget", service_kinds.get("PodDisruptionBudget", {}).get("spec", {}).get("selector", {})),
    ):
        report.check(
            not selects(selector, labels),
            f"the service's {kind} does not select the gateway pods",
            f"{selector} selects {labels}",
        )
    ingress_ports = {p.get("port") for rule in policy.get("ingress", []) for p in rule.get("ports", [])}
    report.check(
        ingress_ports == {listen[1], health[1]},
        f"the gateway's NetworkPolicy admits ports {listen[1]} and {health[1]} alone",
        f"it admits {ingress_ports}",
    )
    check_nats_egress("the gateway's NetworkPolicy", policy, config, report)
    report.check(
        not any("ipBlock" in peer for rule in policy.get("egress", []) for peer in rule.get("to", [])),
        "the gateway's NetworkPolicy opens no address range: it calls no upstream itself",
        f"egress: {policy.get('egress')}",
    )
    return docs


def budget(value: int | str) -> int:
    """A PodDisruptionBudget count; a percentage counts as its number, enough to tell
    zero from non-zero."""
    return int(str(value).rstrip("%"))


def check_streams_fit_nats(checked: dict, nats_values: dict, report: Report) -> None:
    cluster = nats_values.get("config", {}).get("cluster", {})
    nodes = cluster.get("replicas", 1) if cluster.get("enabled") else 1
    replicas = checked["streams"]["replicas"]
    report.check(
        replicas <= nodes,
        f"[streams] replicas ({replicas}) fits the NATS cluster ({nodes} nodes)",
        "JetStream cannot place more replicas than it has servers",
    )


def check_autoscaled(kubectl: str, base_docs: list[dict], report: Report) -> None:
    """overlays/autoscaled: the base with components/keda. The ScaledObject owns the
    replica count, scales on the pools' gauges, and the Deployment leaves the count to
    it; the base without the component keeps its own."""
    check_kustomization_lists_every_file(report, KEDA_COMPONENT)
    check_kustomization_lists_every_file(report, AUTOSCALED)
    docs = render(kubectl, report, AUTOSCALED)
    if not docs:
        return
    label = "overlays/autoscaled"
    check_schemas(docs, report, BASE_KINDS + ["ScaledObject"], label)
    check_images_named(label, docs, report)
    kinds = by_kind(docs)
    deployment = kinds.get("Deployment", {})
    report.check(
        "replicas" not in deployment.get("spec", {}),
        f"{label}: the Deployment has no spec.replicas (the autoscaler owns the count)",
        f"replicas: {deployment.get('spec', {}).get('replicas')}",
    )
    base_replicas = by_kind(base_docs).get("Deployment", {}).get("spec", {}).get("replicas")
    report.check(base_replicas is not None, "the base without the KEDA component keeps spec.replicas", "none set")

    scaled = kinds.get("ScaledObject", {}).get("spec", {})
    target = scaled.get("scaleTargetRef", {})
    report.check(
        target.get("kind", "Deployment") == "Deployment" and target.get("name") == deployment.get("metadata", {}).get("name"),
        "the ScaledObject scales the webproxy Deployment",
        f"it targets {target}",
    )
    low, high = scaled.get("minReplicaCount", 0), scaled.get("maxReplicaCount", 100)
    report.check(
        base_replicas is not None and low <= base_replicas <= high,
        "the base's replicas lie within the ScaledObject's range: turning KEDA on or off does not jump",
        f"{base_replicas} not in [{low}, {high}]",
    )
    pdb = kinds.get("PodDisruptionBudget", {}).get("spec", {})
    report.check(
        budget(pdb.get("maxUnavailable", 0)) >= 1 or budget(pdb.get("minAvailable", low)) < low,
        "the PodDisruptionBudget lets a node drain evict a pod at minReplicaCount",
        f"{pdb}",
    )

    component = yaml.safe_load((KEDA_COMPONENT / "scaledobject.yaml").read_text())
    placeholders = {t.get("metadata", {}).get("serverAddress") for t in component.get("spec", {}).get("triggers", [])}
    docs_queries = {" ".join(expr.split()) for expr in docs_promql()}
    triggers = scaled.get("triggers", [])
    report.check(bool(triggers), "the ScaledObject has a trigger")
    for trigger in triggers:
        meta = trigger.get("metadata", {})
        query = meta.get("query", "")
        report.check(
            meta.get("serverAddress") not in placeholders,
            f"{label} sets the Prometheus address (the component's is a placeholder)",
            f"serverAddress: {meta.get('serverAddress')}",
        )
        problems = promql_problems(query)
        report.check(not problems, "the KEDA trigger's query is sound and names only the service's metrics", f"{problems}")
        used = set(re.findall(r"\bwebproxy_[a-z0-9_]+", query))
        report.check(
            SCALING_GAUGES <= used,
            "the KEDA trigger weighs waiting work against the pool's pause, effective limit and attempts in flight",
            f"missing: {sorted(SCALING_GAUGES - used)}",
        )
        report.check(
            " ".join(query.split()) in docs_queries,
            "docs/operations.md shows the KEDA trigger's query as it is",
            "copy the ScaledObject's query into its ```promql block in \"Scaling\"",
        )


def check_gateway_overlay(kubectl: str, report: Report) -> None:
    """overlays/gateway: the base and the gateway's together, one namespace for both."""
    check_kustomization_lists_every_file(report, GATEWAY_OVERLAY)
    docs = render(kubectl, report, GATEWAY_OVERLAY)
    if docs:
        check_schemas(docs, report, BASE_KINDS + GATEWAY_KINDS, "overlays/gateway")
        check_images_named("overlays/gateway", docs, report)


def check_images_named(label: str, docs: list[dict], report: Report) -> None:
    """An overlay says where the image comes from: the base's `webproxy` is a name to
    set, published nowhere."""
    images = {
        c.get("image", "")
        for d in docs
        if d.get("kind") == "Deployment"
        for c in d["spec"]["template"]["spec"].get("containers", [])
    }
    report.check(
        len(images) == 1 and all("/" in i.split(":")[0] and ":" in i for i in images),
        f"{label} names one image, from a registry, with a tag",
        f"images: {sorted(images)}",
    )


def check_namespace(docs: list[dict], report: Report) -> None:
    namespaces = [d.get("metadata", {}).get("name") for d in docs if d.get("kind") == "Namespace"]
    report.check(namespaces == [NAMESPACE], f"the base creates the namespace {NAMESPACE}", f"Namespaces: {namespaces}")


def check_every_kustomization_rendered(report: Report) -> None:
    """A kustomization added under deploy/ must be rendered here too."""
    checked = {KUBE, GATEWAY, EXAMPLE_SECRETS, KEDA_COMPONENT, AUTOSCALED, GATEWAY_OVERLAY}
    found = {p.parent for p in DEPLOY.rglob("kustomization.yaml")}
    report.check(
        found == checked,
        "deploy-check renders every kustomization under deploy/",
        f"unchecked: {sorted(str(p.relative_to(REPO)) for p in found - checked)}, "
        f"missing: {sorted(str(p.relative_to(REPO)) for p in checked - found)}",
    )


def example_secrets(kubectl: str, report: Report) -> dict[str, dict[str, str]]:
    """The example Secrets, each a map of its keys to its values."""
    check_kustomization_lists_every_file(report, EXAMPLE_SECRETS)
    docs = render(kubectl, report, EXAMPLE_SECRETS)
    check_schemas(docs, report, ["Secret"] * max(len(docs), 1), "the example Secrets")
    secrets = {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
        for d in docs
        if d.get("kind") == "Secret"
    }
    check_placeholders("the example Secrets", secrets, report)
    return secrets


def check_placeholders(label: str, secrets: dict[str, dict[str, str]], report: Report) -> None:
    values = {f"{name}/{key}": value for name, data in secrets.items() for key, value in data.items()}
    report.check(
        bool(values) and all(v.startswith("not-for-production") for v in values.values()),
        f"{label} hold only placeholders that say not-for-production",
        f"{sorted(k for k, v in values.items() if not v.startswith('not-for-production'))}",
    )


def pod_environment(label: str, container: dict, secrets: dict[str, dict[str, str]], report: Report) -> dict[str, str]:
    """The container's variables, those from Secrets read from the example Secrets;
    every reference must resolve there."""
    env = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            env[var["name"]] = var.get("value", "")
            continue
        value = secrets.get(ref.get("name"), {}).get(ref.get("key"))
        report.check(
            value is not None,
            f"{label}: {var['name']} comes from a key of the example Secrets ({ref.get('name')}/{ref.get('key')})",
            f"they have {sorted((n, sorted(d)) for n, d in secrets.items())}",
        )
        env[var["name"]] = value or ""
    report.check(not container.get("envFrom"), f"{label}: no envFrom (each variable is named)", f"{container.get('envFrom')}")
    return env


def referenced_secrets(spec: dict) -> set[str]:
    return {
        var["valueFrom"]["secretKeyRef"]["name"]
        for c in spec.get("containers", [])
        for var in c.get("env", [])
        if "secretKeyRef" in var.get("valueFrom", {})
    } | {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}


def check_volumes(label: str, spec: dict, configmap: dict, secrets: dict[str, dict[str, str]], report: Report) -> None:
    """Besides its config, a pod mounts only Secrets: injected upstream secrets read as
    files must come from a Secret volume, read-only."""
    mounts = {m["name"]: m for c in spec.get("containers", []) for m in c.get("volumeMounts", [])}
    for volume in spec.get("volumes", []):
        if volume.get("configMap", {}).get("name") == configmap["metadata"]["name"]:
            continue
        name = volume.get("secret", {}).get("secretName")
        report.check(name is not None, f"{label}: volume {volume['name']} is a Secret volume", f"{volume}")
        report.check(name in secrets, f"{label}: volume {volume['name']} is an example Secret's", f"{name}")
        report.check(
            mounts.get(volume["name"], {}).get("readOnly") is True,
            f"{label}: volume {volume['name']} is mounted read-only",
            f"{mounts.get(volume['name'])}",
        )


def authorization_text() -> str:
    """deploy/nats/authorization.conf without its comments, which name subjects and
    users in prose."""
    return re.sub(r"#.*", "", AUTHORIZATION.read_text())


def authorization_users() -> dict[str, str]:
    """deploy/nats/authorization.conf's users, each with the variable its password is
    read from."""
    text = authorization_text()
    return dict(re.findall(r"\buser:\s*([A-Za-z0-9_-]+)\s+password:\s*\$([A-Z][A-Z0-9_]*)", text))


def check_nats_user(label: str, env: dict[str, str], user: str, nats_passwords: dict[str, str], report: Report) -> None:
    """The pod connects as its authorization.conf user, with the password the NATS
    servers read for it."""
    users = authorization_users()
    report.check(
        env.get("WEBPROXY_NATS__USER") == user and user in users,
        f"{label} connects as authorization.conf's user {user}",
        f"WEBPROXY_NATS__USER: {env.get('WEBPROXY_NATS__USER')}; users: {sorted(users)}",
    )
    variable = users.get(user)
    report.check(
        variable is not None and env.get("WEBPROXY_NATS__PASSWORD") == nats_passwords.get(variable),
        f"{label}'s password is the NATS servers' ${variable} in the example Secrets",
        "the example Secrets of the two namespaces disagree",
    )


def check_nats_server_accepts(nats_server: str, passwords: dict[str, str], report: Report) -> None:
    """nats-server reads authorization.conf as the chart includes it, given the example
    Secret's variables, and refuses it without them: the Secret is what it needs."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "authorization.conf").write_text(AUTHORIZATION.read_text())
        config = Path(tmp) / "nats.conf"
        config.write_text(f"listen: 127.0.0.1:-1\njetstream {{ store_dir: {json.dumps(tmp)} }}\ninclude authorization.conf\n")
        # The NATS servers' environment: nothing of the developer's.
        base_env = {"PATH": os.environ.get("PATH", "")}
        for label, env in (("with", {**base_env, **passwords}), ("without", base_env)):
            result = subprocess.run(
                [nats_server, "-t", "-c", str(config)], capture_output=True, text=True, env=env, check=False, timeout=30
            )
            wanted = label == "with"
            report.check(
                (result.returncode == 0) == wanted,
                f"nats-server {'accepts' if wanted else 'refuses'} authorization.conf {label} the example Secret's variables",
                (result.stderr or result.stdout).strip()[-300:],
            )


def check_nats_auth(values: dict, report: Report) -> dict[str, str]:
    """The NATS values include authorization.conf and give the servers every password
    it reads, from the example Secret's keys. Returns that Secret's values."""
    values_text = (NATS / "values.yaml").read_text()
    report.check(
        SET_FILE in values_text,
        "deploy/nats/values.yaml's install command puts authorization.conf in the chart's ConfigMap",
        f"it needs {SET_FILE}",
    )
    secret = yaml.safe_load((NATS / "example-secret.yaml").read_text())
    # The one object outside webproxy's namespace: the NATS release's.
    check_schemas([secret], report, ["Secret"], "deploy/nats/example-secret.yaml", "nats")
    passwords = secret.get("stringData", {})
    check_placeholders("deploy/nats/example-secret.yaml", {secret["metadata"]["name"]: passwords}, report)
    variables = set(authorization_users().values())
    report.check(bool(variables), "deploy/nats/authorization.conf has users with passwords from variables")
    report.check(
        set(passwords) == variables,
        "deploy/nats/example-secret.yaml has one key per password variable of authorization.conf",
        f"keys {sorted(passwords)}, variables {sorted(variables)}",
    )
    env = values.get("container", {}).get("env", {})
    for variable in sorted(variables):
        ref = (env.get(variable) or {}).get("valueFrom", {}).get("secretKeyRef", {}) if isinstance(env.get(variable), dict) else {}
        report.check(
            ref.get("name") == secret["metadata"]["name"] and ref.get("key") in passwords,
            f"the NATS servers read ${variable} from a key of {secret['metadata']['name']}",
            f"container.env.{variable}: {env.get(variable)}",
        )
    return passwords


def strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def promql_problems(expr: str) -> list[str]:
    """What can be checked of a PromQL expression without Prometheus: balanced brackets,
    known metrics and labels, and cluster-wide gauges aggregated with max."""
    problems = []
    bare = strip_strings(expr)
    depth = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for ch in bare:
        if ch in "([{":
            depth.append(ch)
        elif ch in pairs and (not depth or depth.pop() != pairs[ch]):
            problems.append(f"unbalanced {ch!r}")
            break
    if depth:
        problems.append(f"unclosed {depth[-1]!r}")

    used = set()
    for name in re.findall(r"\bwebproxy_[a-z0-9_]+", bare):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in METRICS and name not in HISTOGRAMS:
            used.add((name, name))
        elif base in HISTOGRAMS and base != name:
            used.add((name, base))
        else:
            problems.append(f"unknown metric {name}")
    known_labels = set(TARGET_LABELS)
    for name, base in used:
        known_labels |= METRICS[base] | ({"le"} if name.endswith("_bucket") else set())
    for name, matchers in re.findall(r"\b(webproxy_[a-z0-9_]+)\s*\{([^}]*)\}", bare):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        allowed = METRICS.get(base, set()) | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
        for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
            if label not in allowed:
                problems.append(f"{name} has no label {label}")
    for labels in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", bare):
        for label in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", labels):
            if label not in known_labels:
                problems.append(f"grouping by unknown label {label}")
    for metric in CLUSTER_WIDE:
        for use in re.finditer(rf"\b{metric}\b", bare):
            aggregation = re.search(AGGREGATION, bare[: use.start()])
            if not aggregation or aggregation.group(1) != "max":
                problems.append(f"{metric} is cluster-wide: aggregate it with max, not sum")
    for selector in re.findall(r"\bwebproxy_requests_total\s*\{[^}]*\}", expr):
        if 'outcome="error"' in selector and CALLER_MISTAKES not in selector:
            problems.append(f"an error count must leave out the callers' mistakes with {CALLER_MISTAKES}")
    if "histogram_quantile" in bare and not re.search(r"_bucket\b", bare):
        problems.append("histogram_quantile needs the _bucket series")
    return problems


def check_dashboard(report: Report) -> None:
    path = DEPLOY / "grafana" / "webproxy-dashboard.json"
    try:
        dashboard = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        report.check(False, f"{path.relative_to(REPO)} is JSON", str(e))
        return
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    datasource = variables.get("datasource", {})
    report.check(
        datasource.get("type") == "datasource" and datasource.get("query") == "prometheus",
        "the dashboard has a Prometheus ${datasource} variable",
        f"{datasource}",
    )
    report.check(variables.get("pool", {}).get("type") == "query", "the dashboard has a pool variable")
    panels = dashboard.get("panels", [])
    ids = [p.get("id") for p in panels]
    report.check(len(ids) == len(set(ids)) and None not in ids, "dashboard panel ids are unique", f"{ids}")
    used = set()
    for panel in panels:
        title = panel.get("title")
        sources = [panel.get("datasource")] + [t.get("datasource") for t in panel.get("targets", []) if "datasource" in t]
        report.check(
            all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources),
            f"panel {title!r} queries ${{datasource}}",
            f"{sources}",
        )
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            metrics = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bwebproxy_[a-z0-9_]+", expr)}
            used |= metrics
            problems = promql_problems(expr)
            if any("pool" in METRICS.get(m, ()) for m in metrics) and 'pool=~"$pool"' not in expr:
                problems.append('a pool metric not filtered by pool=~"$pool"')
            report.check(not problems, f"panel {title!r} query {target.get('refId')} is sound", f"{expr}: {problems}")
    report.check(set(METRICS) <= used, "the dashboard shows every metric", f"unused: {sorted(set(METRICS) - used)}")
    in_flight_versus_limit = [
        panel.get("title")
        for panel in panels
        if {"webproxy_in_flight", "webproxy_pool_max_in_flight"}
        <= {m for t in panel.get("targets", []) for m in re.findall(r"\bwebproxy_[a-z0-9_]+", t.get("expr", ""))}
    ]
    report.check(bool(in_flight_versus_limit), "a dashboard panel shows in flight against the pool's limit")


def docs_promql() -> list[str]:
    """The expressions of docs/operations.md's ```promql blocks: one per paragraph, `#`
    lines are comments."""
    blocks = re.findall(r"```promql\n(.*?)```", (REPO / "docs" / "operations.md").read_text(), re.S)
    exprs = []
    for block in blocks:
        for expr in re.split(r"\n\s*\n", block):
            expr = "\n".join(line for line in expr.splitlines() if not line.lstrip().startswith("#")).strip()
            if expr:
                exprs.append(expr)
    return exprs


def check_docs_promql(report: Report) -> None:
    exprs = docs_promql()
    report.check(bool(exprs), "docs/operations.md has PromQL to check")
    for expr in exprs:
        problems = promql_problems(expr)
        report.check(not problems, f"operations.md: {' '.join(expr.split())[:70]}", f"{problems}")


def registered_metrics() -> set[str]:
    """The metric families the code registers, without the `_total` prometheus-client
    adds to counters."""
    names = set()
    for path in METRICS_SOURCES:
        text = path.read_text()
        prefix = re.search(r'Registry::with_prefix\("([a-z_]+)"\)', text)
        for name in re.findall(r'\.register\(\s*"([a-z_]+)"', text):
            names.add(f"{prefix.group(1)}_{name}" if prefix else name)
    return names


def check_metrics_are_the_codes(report: Report) -> None:
    """The metrics the dashboard, the docs and the autoscaler may name are the ones the
    code registers."""
    declared = {re.sub(r"_total$", "", name) for name in METRICS}
    code = registered_metrics()
    report.check(
        declared == code,
        "deploy-check knows exactly the metrics the code registers",
        f"not registered: {sorted(declared - code)}, unknown here: {sorted(code - declared)}",
    )


def docker_pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regular expression over a slash-separated path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def docker_ignores(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves the path out of the build context: the last pattern that
    matches it or a directory above it decides, `!` bringing it back."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = docker_pattern(pattern.removeprefix("!").strip().strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def check_dockerignore(report: Report) -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    missed = [path for path in DOCKER_IGNORED if not docker_ignores(patterns, path)]
    report.check(not missed, ".dockerignore keeps the virtualenvs, node_modules and build directories out", f"in the context: {missed}")
    needed = ["Cargo.toml", "Cargo.lock", "crates/webproxy/src/main.rs", "config/default.toml", "deploy/image-config.toml"]
    dropped = [path for path in needed if docker_ignores(patterns, path)]
    report.check(not dropped, ".dockerignore keeps what the image's build reads", f"ignored: {dropped}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--webproxy", required=True, help="the webproxy binary, for check-config")
    parser.add_argument("--kubectl", required=True, help="kubectl, for its built-in kustomize")
    parser.add_argument("--nats-server", required=True, help="nats-server, to test authorization.conf's config")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every check, not only failures")
    args = parser.parse_args()

    report = Report(args.verbose)
    check_every_kustomization_rendered(report)
    check_kustomization_lists_every_file(report)
    docs = render(args.kubectl, report)
    check_schemas(docs, report, BASE_KINDS, "the base")
    check_namespace(docs, report)
    nats_values = check_nats_values(report)
    nats_passwords = check_nats_auth(nats_values, report)
    check_nats_server_accepts(args.nats_server, nats_passwords, report)
    secrets = example_secrets(args.kubectl, report)
    image_config = (DEPLOY / "image-config.toml").read_text()
    check_config(args.webproxy, "deploy/image-config.toml", image_config, report)
    _, exposed, _ = dockerfile_facts()
    check_listen("deploy/image-config.toml", effective_config(image_config), exposed, report)
    if docs:
        check_deployment_agrees(docs, nats_values, secrets, nats_passwords, args.webproxy, report)
        check_autoscaled(args.kubectl, docs, report)
    gateway_docs = check_gateway(args.kubectl, args.webproxy, docs, secrets, nats_passwords, report)
    check_gateway_overlay(args.kubectl, report)
    used = {
        name
        for d in docs + gateway_docs
        if d.get("kind") == "Deployment"
        for name in referenced_secrets(d["spec"]["template"]["spec"])
    }
    report.check(
        set(secrets) == used,
        "the example Secrets are exactly the ones the Deployments read",
        f"unused: {sorted(set(secrets) - used)}, missing: {sorted(used - set(secrets))}",
    )
    check_metrics_are_the_codes(report)
    check_dashboard(report)
    check_docs_promql(report)
    check_dockerignore(report)

    if report.failures:
        print(f"deploy-check: {report.failures} of {report.passed + report.failures} checks failed", file=sys.stderr)
        return 1
    print(f"deploy-check: all {report.passed} checks of deploy/ hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
