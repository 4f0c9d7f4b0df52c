#!/usr/bin/env python3
"""Validates every manifest in deploy/kubernetes (and examples/) against its schema.

Core kinds: `kubernetes-validate` in strict mode (unknown fields are errors), against the
oldest and the newest Kubernetes version it ships schemas for (from 1.25). The
ServiceMonitor, and the alert rules of deploy/prometheus as a PrometheusRule: the
Prometheus Operator's CRD schemas, as compiled into the pydantic models
of `cloudcoil-models-prometheus-operator` (types, patterns, required fields), plus a
round trip that rejects fields the schema does not know. A kind with no schema is an error,
never skipped. Then what no schema says: non-root, read-only root filesystem, probes on
/healthz and /readyz, resource requests, the token from a Secret, and the Service and the
ServiceMonitor reaching the pods' port. Exit 0: all valid; 1: invalid; 3: a validator is not installed.

    python3 -m pip install kubernetes-validate cloudcoil-models-prometheus-operator
    python3 deploy/kubernetes/validate.py
"""
import pathlib
import sys

INSTALL = (
    "python3 -m pip install kubernetes-validate==1.37.0 "
    "cloudcoil-models-prometheus-operator==0.80.1.0"
)

try:
    import pydantic
    import yaml
    import kubernetes_validate
    import kubernetes_validate.utils as kv_utils
    from cloudcoil.models.prometheus_operator import v1 as monitoring_v1
except ImportError as missing:
    print(f"validate.py: {missing.name} is not installed: {INSTALL}", file=sys.stderr)
    sys.exit(3)

OLDEST = "1.25"
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring_v1.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring_v1.PrometheusRule,
}
RULES = pathlib.Path(__file__).parent.parent / "prometheus" / "lease-router.rules.yml"


def prometheus_rule():
    """The PrometheusRule deploy/README.md makes of the alert rules (their `groups:` under
    `spec:`), for the Prometheus Operator."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "lease-router"},
        "spec": yaml.safe_load(RULES.read_text()),
    }


def unknown_fields(given, known, path=""):
    """Paths in `given` that the model dropped: fields its schema does not have."""
    if isinstance(given, dict) and isinstance(known, dict):
        out = []
        for key, value in given.items():
            if key not in known:
                out.append(f"{path}.{key}".lstrip("."))
            else:
                out += unknown_fields(value, known[key], f"{path}.{key}")
        return out
    if isinstance(given, list) and isinstance(known, list):
        return [p for i, (g, k) in enumerate(zip(given, known)) for p in unknown_fields(g, k, f"{path}[{i}]")]
    return []


def check(doc, where):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CUSTOM:
        try:
            model = CUSTOM[key].model_validate(doc)
        except pydantic.ValidationError as err:
            return [f"{where}: {err}"]
        dumped = model.model_dump(by_alias=True, exclude_none=True, mode="json")
        return [f"{where}: unknown field {p}" for p in unknown_fields(doc, dumped)]
    errors = []
    for version in (OLDEST, kv_utils.latest_version()):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            errors.append(f"{where} (Kubernetes {version}): {path}: {err.message}")
        except kv_utils.SchemaNotFoundError as err:
            errors.append(f"{where}: no schema: {err.message}")
    return errors


def policy(docs):
    """What the schemas cannot say: the hardening and the wiring between the manifests."""
    errors = []
    by_kind = {}
    for where, doc in docs:
        by_kind.setdefault(doc.get("kind"), []).append((where, doc))

    def need(ok, what):
        if not ok:
            errors.append(what)

    for where, dep in by_kind.get("Deployment", []):
        pod = dep["spec"]["template"]
        spec = pod["spec"]
        need(spec.get("securityContext", {}).get("runAsNonRoot") is True, f"{where}: runAsNonRoot")
        secrets = {v["name"] for v in spec.get("volumes", []) if "secret" in v}
        for c in spec["containers"]:
            name = f"{where} container {c['name']}"
            sc = c.get("securityContext", {})
            need(sc.get("readOnlyRootFilesystem") is True, f"{name}: readOnlyRootFilesystem")
            need(sc.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation")
            need("ALL" in sc.get("capabilities", {}).get("drop", []), f"{name}: drop ALL capabilities")
            requests = c.get("resources", {}).get("requests", {})
            need({"cpu", "memory"} <= requests.keys(), f"{name}: cpu and memory requests")
            probe = lambda kind: c.get(kind, {}).get("httpGet", {}).get("path")
            need(probe("readinessProbe") == "/readyz", f"{name}: readinessProbe on /readyz")
            need(probe("livenessProbe") == "/healthz", f"{name}: livenessProbe on /healthz")
            env = {e["name"]: e for e in c.get("env", [])}
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            token_file = env.get("LEASE_ROUTER_HTTP_TOKEN_FILE", {}).get("value", "")
            from_mount = any(
                m["name"] in secrets and token_file.startswith(m["mountPath"].rstrip("/") + "/")
                for m in mounts.values()
            )
            from_env = "secretKeyRef" in env.get("LEASE_ROUTER_HTTP_TOKEN", {}).get("valueFrom", {})
            need(from_mount or from_env, f"{name}: the HTTP token from a Secret (file or env)")
            ports = {p["name"] for p in c.get("ports", [])}
            for _, svc in by_kind.get("Service", []):
                labels = pod["metadata"]["labels"]
                if all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()):
                    for port in svc["spec"]["ports"]:
                        need(port["targetPort"] in ports, f"{where}: Service port {port['name']} targets a container port")
    for where, mon in by_kind.get("ServiceMonitor", []):
        wanted = mon["spec"]["selector"]["matchLabels"]
        services = [
            svc for _, svc in by_kind.get("Service", [])
            if all(svc["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        ]
        need(services, f"{where}: selects no Service")
        for endpoint in mon["spec"]["endpoints"]:
            need(
                any(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services),
                f"{where}: endpoint port {endpoint['port']} is no port of the Service",
            )
            need(endpoint.get("path") == "/metrics", f"{where}: scrapes /metrics")
    return errors


def main(argv):
    root = pathlib.Path(argv[1]) if len(argv) > 1 else pathlib.Path(__file__).parent
    files = sorted(p for p in root.rglob("*.yaml"))
    if not files:
        print(f"validate.py: no manifests under {root}", file=sys.stderr)
        return 1
    errors, docs = [], []
    for path in files:
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d):
            where = f"{path.relative_to(root)}[{i}] {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            found = check(doc, where)
            errors += found
            docs.append((where, doc))
            if not found:
                print(f"ok {where}")
    rule = prometheus_rule()
    where = f"{RULES.name} as PrometheusRule/lease-router"
    found = check(rule, where)
    errors += found
    if not found:
        print(f"ok {where}")
    count = len(docs) + 1
    if not errors:
        errors += policy(docs)
    for error in errors:
        print(f"ERROR {error}")
    print(f"{count} manifests, {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
