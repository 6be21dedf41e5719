"""Faults on the real gateway (in-process vLLM, the embedded model, SQLite on disk): killed with SIGKILL while
feedback is being written, restarted on the same database, nothing it acknowledged is lost and the database is
intact."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time

import httpx
import psutil
import pytest

from adapters.hosting.engine_processes import SERVER_NAME
from tests.servers import alive, calm_argv, free_port, http, running, wait_until

pytestmark = pytest.mark.slow
MODEL = "calm-smollm2-135m"


@pytest.fixture(scope="module")
def identity_artifact(tmp_path_factory, embedded_model_dir):
    from training.artifacts import write_identity_artifact

    path = tmp_path_factory.mktemp("identity") / "artifact"
    write_identity_artifact(path, with_reference=False)
    return path


def test_sigkill_mid_write_loses_no_acknowledged_feedback(tmp_path, identity_artifact):
    db = tmp_path / "gw.sqlite3"
    env = {"CALM_DB_PATH": str(db), "CALM_ARTIFACT": str(identity_artifact), "CALM_RAW_CONFIDENCE": "false"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Say yes."}]}
    acknowledged: list[tuple[str, bool]] = []
    with running(calm_argv("serve", "--port", str(port)), f"{base}/health", tmp_path / "a.log", env) as proc:
        ids = [http.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["id"] for _ in range(60)]
        lock = threading.Lock()

        def send(response_id: str, verdict: bool):
            try:
                r = http.post(f"{base}/v1/feedback", json={"response_id": response_id, "correct": verdict}, timeout=10)
            except httpx.HTTPError:
                return  # the gateway died under this one: not acknowledged
            if r.status_code == 200:
                with lock:
                    acknowledged.append((response_id, verdict))

        threads = [threading.Thread(target=send, args=(rid, i % 3 == 0)) for i, rid in enumerate(ids)]
        for i, t in enumerate(threads):
            t.start()
            if i == 30:
                # Once some verdicts are acknowledged (a fixed 50 ms sleep raced the first answers on a busy
                # machine), kill it mid-write: the other feedback requests are in flight.
                deadline = time.monotonic() + 30
                while not acknowledged and time.monotonic() < deadline:
                    time.sleep(0.005)
                # The gateway alone, as the OOM killer would: its engine core and the server it was forked from
                # are not its children and must not outlive it (adapters/hosting/engine_processes.py).
                started = psutil.Process(proc.pid).children(recursive=True)
                servers = [p for p in started if p.name() == SERVER_NAME]  # read while they run
                os.kill(proc.pid, signal.SIGKILL)
        for t in threads:
            t.join()
        proc.wait()
    assert servers  # the server and the engine core forked from it
    wait_until("the killed gateway's engine processes to exit", lambda: not any(map(alive, started)), 120, 0.2)
    assert 0 < len(acknowledged) < len(ids), len(acknowledged)
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    # Restarted on the same database. Feedback needs no engine: the restart serves an upstream engine that is not
    # there (nothing is generated), which spares the test a second vLLM start; /v1/models answers once it has started.
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    restart = {**env, "CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": f'["http://127.0.0.1:{free_port()}"]'}
    with running(calm_argv("serve", "--port", str(port)), f"{base}/v1/models", tmp_path / "b.log", restart):
        for response_id, verdict in acknowledged:  # the same verdict again: "already recorded", never a conflict
            r = http.post(f"{base}/v1/feedback", json={"response_id": response_id, "correct": verdict}, timeout=10)
            assert r.status_code == 200 and r.json()["recorded"] is False, (response_id, r.text)


def test_an_engine_core_that_died_turns_liveness_to_503_so_the_gateway_is_restarted(tmp_path, identity_artifact):
    """vLLM never restarts an engine core that died, so a gateway whose in-process engine died can answer nothing
    again. Its engine core killed (SIGKILL): every answer is a clear 503, and /health/live turns 503 too (code
    engine_dead), so that a liveness probe restarts the gateway instead of leaving it up and unable to answer."""
    import psutil

    env = {"CALM_DB_PATH": str(tmp_path / "gw.sqlite3"), "CALM_ARTIFACT": str(identity_artifact)}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Say yes."}]}
    with running(calm_argv("serve", "--port", str(port)), f"{base}/health", tmp_path / "gw.log", env) as proc:
        assert http.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert http.get(f"{base}/health/live", timeout=30).status_code == 200
        children = psutil.Process(proc.pid).children(recursive=True)
        # The engine cores: forked by the forkserver (adapters/hosting/engine_processes.py), the gateway's only grandchildren.
        cores = [p for p in children if p.ppid() != proc.pid]
        assert len(cores) == 1, [(p.pid, p.ppid(), " ".join(p.cmdline())[:120]) for p in children]
        cores[0].send_signal(signal.SIGKILL)
        live = wait_until("liveness to turn 503", lambda: (r := http.get(f"{base}/health/live", timeout=30))
                          .status_code == 503 and r, timeout=120)
        assert live.json()["error"]["code"] == "engine_dead" and "died" in live.json()["error"]["message"]
        answer = http.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable_error"
        assert http.get(f"{base}/health/ready", timeout=30).status_code == 503
        assert proc.poll() is None  # the process stays up: restarting it is the orchestrator's call
