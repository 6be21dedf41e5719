"""Starting real servers for end-to-end tests: subprocesses on free loopback ports, logs kept for failures."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# Every test's HTTP call goes through this one client. httpx.get() and its siblings build a client per call, and with it
# an SSL context (certifi's bundle parsed: ~20 ms of CPU) even for plain http: a gateway's start-up polls alone built
# hundreds. The timeout only ends a hang: on a loaded 2-core machine (a worker training beside the gateway, another
# file's engines) an answer can take longer than httpx's 5 s default, and a slow answer is not a failure. An idle
# connection is dropped after 2 s: vLLM's servers close theirs after 5 (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a request
# sent on one as it closes fails unanswered.
http = httpx.Client(timeout=120, limits=httpx.Limits(keepalive_expiry=2))


_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free loopback port *below* the kernel's ephemeral range. A port from bind(0) is an ephemeral one, and a server
    binds it only after its start-up (a gateway: after its engines, a minute later), while vLLM's engines, ZMQ and
    gloo take ephemeral ports meanwhile: one of them took a test's port once (Prometheus: "address already in use").
    Below the range the kernel never hands a port out by itself; each port is given once per process."""
    low, high = _worker_ports(10000, _ephemeral_low())
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


def _worker_ports(low: int, high: int) -> tuple[int, int]:
    """Under pytest-xdist each worker draws from its own share of the range: a port checked free by one worker could
    otherwise be taken by a server the other starts before this one binds it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", "gw0"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0
    width = (high - low) // max(count, 1)
    return low + index * width, low + (index + 1) * width


def wait_until(what: str, predicate, timeout: float = 180.0, every: float = 1.0):
    """Poll `predicate` until it returns something truthy and return that; the deadline only turns a hang into a clear
    failure, it is not a speed requirement."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def alive(process) -> bool:
    """Whether a psutil process still runs (a zombie waiting for a reaper that never comes, in a container, has ended)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def metric_values(base: str, name: str, **labels: str) -> list[float]:
    """The values of the samples named `name` in `base`/metrics (the gateway's or vLLM's) whose labels include
    `labels`, read with prometheus_client's own parser of the text format. The read may take long on a loaded machine
    (the retraining loop's tests poll beside a training worker): its timeout only ends a hang (`http`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get(f"{base}/metrics").text
    return [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()]


@contextmanager
def running(argv: list[str], health_url: str, log_path: Path, env: dict | None = None, timeout: float = 240.0,
            cwd: Path = REPO):
    """Start a process, wait until `health_url` answers 200, yield it, then stop it (SIGTERM, then SIGKILL)."""
    with background(argv, log_path, env, cwd) as proc:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[:3]} exited with {proc.returncode}; log:\n{log_path.read_text()[-3000:]}")
            try:
                if http.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{health_url} not healthy after {timeout}s; log:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield proc


def python(code: str, *args: str) -> str:
    """`code` run by a fresh interpreter in the checkout; its stdout (a failure's stderr in the assertion)."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def calm_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "calm_cli", *args]


@contextmanager
def background(argv: list[str], log_path: Path, env: dict | None = None, cwd: Path = REPO):
    """Start a process, yield it, then stop it with its whole process group (SIGTERM, then SIGKILL after 30 s)."""
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def watch_start(base: str, proc: subprocess.Popen, log_path: Path, timeout: float = 300.0) -> list[dict]:
    """Poll a starting gateway until an answer is served: each round asks /health/live, /health/ready, a chat answer,
    then /health/ready again, and records the statuses (None: nothing listens yet) and the answer's error type."""
    question = {"model": "calm-smollm2-135m", "messages": [{"role": "user", "content": "Which gas do plants absorb?"}],
                "options": ["oxygen", "carbon dioxide"]}

    def status(method: str, path: str, **kwargs) -> tuple[int | None, httpx.Response | None]:
        try:
            r = http.request(method, f"{base}{path}", timeout=60, **kwargs)
            return r.status_code, r
        except httpx.TransportError:
            return None, None

    rounds: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}; log:\n{log_path.read_text()[-3000:]}")
        live, _ = status("GET", "/health/live")
        ready_before, _ = status("GET", "/health/ready")
        answer, response = status("POST", "/v1/chat/completions", json=question)
        ready_after, _ = status("GET", "/health/ready")
        error = response.json().get("error", {}).get("type") if response is not None and answer != 200 else None
        retry_after = response.headers.get("retry-after") if response is not None else None
        rounds.append({"live": live, "ready_before": ready_before, "answer": answer, "answer_error": error,
                       "retry_after": retry_after, "ready_after": ready_after})
        if answer == 200 and ready_after == 200:
            return rounds
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer after {timeout}s; last rounds {rounds[-3:]}; log:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
