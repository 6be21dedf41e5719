"""LiteLLM's proxy, the OpenAI-compatible gateway many platforms already run, in front of ours (tests and
benchmarks). It lives in a virtual environment of its own (benchmarks/.venv-litellm, made on first use): its pins
differ from vLLM's."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from tests.servers import REPO, free_port, running

LITELLM = "litellm[proxy]==1.108.7"
LITELLM_VENV = REPO / "benchmarks" / ".venv-litellm"
MASTER_KEY = "sk-litellm-test"


def litellm_binary() -> Path:
    """The proxy's executable, installed once. scripts/test.sh starts `python -m tests.litellm_proxy` in the background
    at the beginning of the run; whoever comes second waits on the lock until the install is complete."""
    binary = LITELLM_VENV / "bin" / "litellm"
    LITELLM_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(LITELLM_VENV.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            print(f"installing {LITELLM} into {LITELLM_VENV} (once)", flush=True)
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(LITELLM_VENV)], check=True)
            # --no-compile: byte-compiling all of LiteLLM took CPU from the tests it overlaps; Python compiles what
            # the proxy imports when it first starts.
            subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "--no-compile", LITELLM], check=True)
    return binary


@contextmanager
def litellm_proxy(model: str, api_base: str, work: Path, settings: dict | None = None, prefix: list[str] | None = None,
                  key: str = MASTER_KEY):
    """A LiteLLM proxy serving `model` from the OpenAI-compatible server at `api_base` (ending in /v1), its config and
    log in `work`; yields its base URL. `settings` are extra top-level config sections (general_settings,
    litellm_settings); `prefix` goes before the command (e.g. taskset), `key` is its master key."""
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    config = work / "litellm.yaml"
    body = {"model_list": [{"model_name": model, "litellm_params": {
        "model": f"hosted_vllm/{model}", "api_base": api_base, "api_key": "none"}}],
        "litellm_settings": {"telemetry": False}}
    for section, values in (settings or {}).items():
        body[section] = {**body.get(section, {}), **values}
    config.write_text(json.dumps(body))
    argv = [*(prefix or []), str(litellm_binary()), "--config", str(config), "--port", str(port), "--num_workers", "1"]
    with running(argv, f"http://127.0.0.1:{port}/health/liveliness", work / "litellm.log",
                 env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": key}, timeout=300):
        yield f"http://127.0.0.1:{port}"


if __name__ == "__main__":
    print(litellm_binary())
