"""The fleet's deployment files, checked offline: the Kubernetes manifests against the API's schemas
(kubernetes-validate), the HAProxy file with HAProxy's own checker, and the compose profile `fleet` against the flags
tests/test_fleet.py runs for real."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.fleet import ENGINE_ENV, engine_argv

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((REPO / "deploy/k8s").glob("*.yaml"))
# The plugin's flags: what makes a stock vLLM server a CALM engine (docs/engines.md).
PLUGIN_FLAGS = [["--logprobs-mode", "processed_logprobs"], ["--enable-lora"], ["--max-lora-rank", "64"],
                ["--middleware", "adapters.vllm_plugins.warm.ServedVersionsFirst"]]


def documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def flags_in(argv: list[str], flags: list[str]) -> bool:
    return any(argv[i:i + len(flags)] == flags for i in range(len(argv)))


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_kubernetes_manifests_validate_against_the_api_schemas(version):
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap", "PersistentVolumeClaim"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on an unknown field or a wrong type


def test_kubernetes_shape_matches_the_fleet():
    """Engines: stock vLLM with the plugin flags and the registry in their environment, as many stable names as the
    gateways' CALM_UPSTREAM_ENGINE_URLS lists; gateways in upstream mode with ready/live probes; one registry volume."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in documents()}
    engines = docs[("StatefulSet", "calm-engine")]["spec"]
    container = engines["template"]["spec"]["containers"][0]
    argv = container["command"] + container["args"]
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"] and "calm" not in " ".join(argv[:3])
    assert all(flags_in(argv, f) for f in PLUGIN_FLAGS)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and env["CALM_REGISTRY_DIR"] == "/var/lib/calm/registry"
    config = docs[("ConfigMap", "calm-fleet")]["data"]
    names = [f"http://calm-engine-{i}.calm-engine:8000" for i in range(engines["replicas"])]
    assert json.loads(config["CALM_UPSTREAM_ENGINE_URLS"]) == names and config["CALM_ENGINE"] == "upstream"
    assert docs[("Service", "calm-engine")]["spec"]["clusterIP"] == "None"
    gateway = docs[("Deployment", "calm-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health/live"
    claims = {v["persistentVolumeClaim"]["claimName"] for d in documents() if d["kind"] in ("Deployment", "StatefulSet")
              for v in d["spec"]["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in v}
    assert claims == {"calm-registry"}


def pod_specs() -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in documents()
            if d["kind"] in ("Deployment", "StatefulSet")}


def secret_env(container: dict) -> dict[str, str]:
    """Variable -> the calm-secrets key it comes from."""
    return {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", [])
            if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "calm-secrets"}


def test_kubernetes_processes_get_the_keys_their_settings_require():
    """Production rules (the ConfigMap's environment) refuse the development admin key: every process that reads the
    gateway's settings gets the real one (the worker crash-looped without it); the engines require their key and the
    gateways send that same key."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in documents()}
    assert docs[("ConfigMap", "calm-fleet")]["data"]["CALM_ENVIRONMENT"] != "development"
    pods = pod_specs()
    gateway, worker = (secret_env(pods[name]["containers"][0]) for name in ("calm-gateway", "calm-worker"))
    engine = secret_env(pods["calm-engine"]["containers"][0])
    assert gateway["CALM_ADMIN_KEY"] == worker["CALM_ADMIN_KEY"] == "admin-key"
    assert engine["VLLM_API_KEY"] == gateway["CALM_UPSTREAM_API_KEY"] == "engine-key"


def test_kubernetes_pods_run_unprivileged():
    """UID 10001 (the images' user), no privilege escalation, no capabilities, the runtime's seccomp profile, no
    service-account token; read-only roots for the processes that write only caches, under HOME on a writable /tmp."""
    for name, spec in pod_specs().items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] and pod["runAsUser"] == pod["runAsGroup"] == pod["fsGroup"] == 10001, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"} and spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
            if name == "calm-worker":  # writes job folders and weights beside the image's model (fleet.yaml says why)
                continue
            assert context["readOnlyRootFilesystem"] is True, name
            env = {e["name"]: e.get("value") for e in container["env"]}
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert env["HOME"] == "/tmp" and "emptyDir" in next(v for v in spec["volumes"] if v["name"] == mounts["/tmp"])
    assert "USER 10001:10001" in (REPO / "Dockerfile").read_text()


def test_kubernetes_network_policies_admit_only_what_each_pod_serves():
    """Every pod is selected by a policy with Ingress; the engines admit the gateways alone (vLLM's key does not cover
    /invocations) and reach nothing; the gateways admit their port (clients, the Service, Prometheus); the worker
    admits nothing."""
    policies = {d["metadata"]["name"]: d["spec"] for d in documents() if d["kind"] == "NetworkPolicy"}
    labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in documents()
              if d["kind"] in ("Deployment", "StatefulSet")}
    for name, pod_labels in labels.items():
        selecting = [p for p in policies.values() if "Ingress" in p["policyTypes"]
                     and p["podSelector"]["matchLabels"].items() <= pod_labels.items()]
        assert selecting, f"no NetworkPolicy selects {name}"
    engine = policies["calm-engine"]
    assert engine["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app": "calm-gateway"}}}],
                                  "ports": [{"protocol": "TCP", "port": 8000}]}]
    assert "Egress" in engine["policyTypes"] and engine["egress"] == []
    assert policies["calm-gateway"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    assert policies["calm-worker"]["ingress"] == []


def test_haproxy_config_is_valid():
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(haproxy).exists():
        pytest.fail("haproxy not installed: scripts/test.sh installs Debian's package")
    env = {"CALM_LB_BIND": "127.0.0.1:1", "CALM_ENGINE_LB_BIND": "127.0.0.1:2", "CALM_GATEWAY_1": "127.0.0.1:3",
           "CALM_GATEWAY_2": "127.0.0.1:4", "CALM_ENGINE_1": "127.0.0.1:5", "CALM_ENGINE_2": "127.0.0.1:6"}
    r = subprocess.run([haproxy, "-c", "-f", str(REPO / "deploy/haproxy/haproxy.cfg")], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "Configuration file is valid" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "WARNING" not in r.stdout + r.stderr


def test_compose_fleet_profile_runs_the_tested_shape():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    fleet = {name for name, s in services.items() if "fleet" in s.get("profiles", [])}
    assert fleet == {"engine-1", "engine-2", "gateway-1", "gateway-2", "haproxy"}
    tested = engine_argv(Path("/m"), 0)
    for name in ("engine-1", "engine-2"):
        argv = services[name]["entrypoint"][1:] + services[name]["command"]
        assert all(flags_in(argv, f) for f in PLUGIN_FLAGS) and all(flags_in(tested, f) for f in PLUGIN_FLAGS)
        cpu_blocks = ["--block-size", "32"]  # the CPU fleet's engines: options scored token by token (FLEET_CPU_BLOCK_SIZE)
        assert flags_in(argv, cpu_blocks) and flags_in(tested, cpu_blocks)
        whole_prefills = ["--no-enable-chunked-prefill"]  # seeded requests on a CPU engine (CPU_CHUNKED_PREFILL)
        assert flags_in(argv, whole_prefills) and flags_in(tested, whole_prefills)
        assert ENGINE_ENV.items() <= services[name]["environment"].items()  # as tests/fleet.py runs them
    for name in ("gateway-1", "gateway-2"):
        env = services[name]["environment"]
        assert env["CALM_ENGINE"] == "upstream" and env["CALM_DB_URL"] == services["gateway"]["environment"]["CALM_DB_URL"]
        assert json.loads(env["CALM_UPSTREAM_ENGINE_URLS"]) == ["http://engine-1:8000", "http://engine-2:8000"]
    proxy = services["haproxy"]["environment"]
    assert proxy["CALM_GATEWAY_1"].startswith("gateway-1:") and proxy["CALM_ENGINE_2"].startswith("engine-2:")
