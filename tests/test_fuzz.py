"""The OpenAPI document is the contract: schemathesis generates requests from the gateway's own document and sends
them to the real gateway on the real engine (the embedded model, the shipped artifact). No answer may be a 5xx, and
every answer must match what the document says: its status codes, content types, headers and bodies; schema-invalid
requests must be refused.

CI runs a quick form (CALM_FUZZ_EXAMPLES examples per operation, default 20); `CALM_FUZZ_EXAMPLES=150 pytest
tests/test_fuzz.py` is the long form (2,000+ requests). Generated requests reach the engine with at most 4 tokens
(CALM_MAX_TOKENS_LIMIT), which keeps the run short without changing any code path.

Every schemathesis check runs, schema-valid acceptance included: the document states the request rules
(patterns, bounds, the user message, rules between fields as if/then), so a schema-valid request is never refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import date

import pytest

from tests.recorded import record_keyed, write_markdown
from tests.servers import calm_argv, free_port, running

pytestmark = pytest.mark.slow
CHECKS = "all"


def test_fuzzed_requests_get_no_5xx_and_conform_to_the_openapi_document(tmp_path, embedded_model_dir):
    examples = int(os.environ.get("CALM_FUZZ_EXAMPLES", "20"))
    port = free_port()
    env = {"CALM_DB_PATH": str(tmp_path / "gw.sqlite3"), "CALM_MAX_TOKENS_LIMIT": "4", "CALM_RAW_CONFIDENCE": "false"}
    with running(calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/health", tmp_path / "gw.log", env):
        st = [sys.executable, "-m", "schemathesis.cli", "run", f"http://127.0.0.1:{port}/openapi.json",
              "--checks", CHECKS, "--max-examples", str(examples), "--phases", "examples,coverage,fuzzing",
              # One worker: with threads, hypothesis's lambda descriptions hit CPython 3.11's ast race
              # (gh-106905, "AST constructor recursion depth mismatch"), an error of the tool, not of the gateway.
              "--workers", "1", "--seed", "1", "-H", "Authorization: Bearer dev-admin-key",
              "--suppress-health-check", "all", "--request-timeout", "120"]
        began = time.monotonic()
        done = subprocess.run(st, capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - began
    summary = done.stdout[-6000:]
    print(summary)
    generated = re.search(r"(\d+) generated", done.stdout)
    assert generated and int(generated.group(1)) >= 10 * examples, summary
    assert done.returncode == 0, summary
    assert "Traceback" not in (tmp_path / "gw.log").read_text()  # no request reached an unhandled error
    operations = re.search(r"Operations:\s+(\d+) selected", done.stdout)
    record(examples, int(generated.group(1)), int(operations.group(1)) if operations else None, seconds)


def record(examples: int, generated: int, operations: int | None, seconds: float) -> None:
    """One row per examples setting (the CI form and the long form), the newest run of each."""
    runs = record_keyed("fuzz", {str(examples): {"generated": generated, "operations": operations,
                                                 "seconds": round(seconds), "date": date.today().isoformat()}})
    lines = ["| examples per operation | operations | requests generated | failing | schemathesis run (s) | date |",
             "|---:|---:|---:|---:|---:|---|"]
    for n, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {n} | {run['operations']} | {run['generated']:,} | 0 | {run['seconds']} | {run['date']} |")
    write_markdown("fuzz", "\n".join(lines))
