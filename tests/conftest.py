"""Shared fixtures. Heavy ones (the real model) are session-scoped and only built by tests marked slow."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.readme_numbers import per_file

# torch with 2 threads on a busy 2-core machine slows by 10-100x (oversubscription); tests stay single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
os.environ.setdefault("CALM_HOME", str(REPO / ".calm"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"benchmark data not found at {SHARED_DATA}: tests read ../shared/data beside the checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    from calm_core.models import prepare_embedded

    return prepare_embedded("float32")


@pytest.fixture(scope="session")
def embedded_model(embedded_model_dir):
    import torch

    torch.set_num_threads(1)
    from training.scoring import load_hf_model

    return load_hf_model(str(embedded_model_dir), "float32")


@pytest.fixture(scope="session")
def shipped_artifact():
    """The artifact `calm serve` uses by default on the embedded model."""
    from calm_cli.serving import DEFAULT_ARTIFACTS
    from calm_core.artifact import load_artifact
    from calm_core.models import EMBEDDED_ID

    return load_artifact(DEFAULT_ARTIFACTS[EMBEDDED_ID])


@pytest.fixture(scope="session")
def shipped_model(shipped_artifact, embedded_model_dir):
    """The embedded model with the shipped LoRA adapter applied by peft (not merged: independent of the merged folder
    the gateway serves)."""
    import torch
    from peft import PeftModel

    from training.scoring import load_hf_model

    torch.set_num_threads(1)
    model, tokenizer = load_hf_model(str(embedded_model_dir), "float32")
    if shipped_artifact.adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(shipped_artifact.adapter_dir)).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def free_form_model(shipped_artifact, embedded_model_dir):
    """The embedded model with the shipped free-form mode's adapter applied by peft, and that mode's head."""
    import torch
    from peft import PeftModel

    from training.scoring import load_hf_model

    torch.set_num_threads(1)
    mode = shipped_artifact.free_form
    model, tokenizer = load_hf_model(str(embedded_model_dir), "float32")
    if mode.adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(mode.adapter_dir)).eval()
    return model, tokenizer, mode.head


@pytest.fixture(scope="module")
def postgres_url():
    from tests.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory):
    """A real S3 API on this machine (moto's server) with one bucket "calm-registry": (filesystem, the AWS variables
    every S3 client here reads, also set in this process while the module runs; give them to subprocesses)."""
    import sys

    from tests.servers import free_port, running

    pytest.importorskip("s3fs")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    env = {"AWS_ACCESS_KEY_ID": "calm", "AWS_SECRET_ACCESS_KEY": "calm-secret", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    with running(argv, f"http://127.0.0.1:{port}/moto-api/", log, timeout=60), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("calm-registry")
        yield fs, env


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    """A fresh database of each backend: a SQLite file, or a PostgreSQL database emptied of every table."""
    if request.param == "sqlite":
        yield str(tmp_path / "g.sqlite3")
        return
    url = request.getfixturevalue("postgres_url")
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("DROP SCHEMA public CASCADE"))
        c.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    yield url


# -- order: the slowest files first -----------------------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    """Files in the order of their seconds in the published run (benchmarks/results/test-times.md), slowest first,
    tests within a file as written. With two pytest-xdist workers (scripts/test.sh) the longest files then start at
    once instead of one of them starting last while the other worker idles; every worker sorts alike."""
    published = REPO / "benchmarks" / "results" / "test-times.md"
    if not published.is_file():
        return
    _, seconds = per_file(published)
    # A file the published run does not list is unmeasured: it starts first, so a slow new one never starts last.
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))


# -- where the time goes: per file and per test, printed at the end of every run ---------------------------------------
_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # setup + call + teardown: a module-scoped server's start counts in the first test that uses it
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def _times_table(top: int = 30) -> str:
    from collections import defaultdict

    files: dict[str, list[float]] = defaultdict(list)
    for nodeid, seconds in _SECONDS.items():
        files[nodeid.split("::")[0]].append(seconds)
    total = sum(_SECONDS.values())
    lines = [f"Test time: {total / 60:.1f} min in {len(_SECONDS)} tests (setup + call + teardown, summed)", "",
             "| file | tests | seconds | share |", "|---|---:|---:|---:|"]
    for name, secs in sorted(files.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {len(secs)} | {sum(secs):.1f} | {sum(secs) / max(total, 1e-9):.1%} |")
    lines += ["", f"Slowest {top} tests:", "", "| test | seconds |", "|---|---:|"]
    for nodeid, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {nodeid} | {seconds:.1f} |")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _SECONDS:
        return
    table = _times_table()
    terminalreporter.write_sep("=", "time per file")
    terminalreporter.write(table)
    out = os.environ.get("CALM_TEST_TIMES_OUT")  # scripts/test.sh sets it (.calm/test-times.md by default)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table)
