"""Shared fixtures. Heavy ones (the real model) are session-scoped and only built by tests marked slow."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import sys
from pathlib import Path

import pytest

from calm_core.collector import collect_young_less_often
from scripts.readme_numbers import per_file
from tests.memory_budget import MemoryBudget, PeakMemory, machine_capacity_gb

# torch with 2 threads on a busy 2-core machine slows by 10-100x (oversubscription); tests stay single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
os.environ.setdefault("CALM_HOME", str(REPO / ".calm"))
# Every engine the tests start (gateways, `calm eval`, the worker) with a 128 MB KV cache instead of the CPU default's
# 512: each holds 0.4 GB less (a default gateway's three engines 6.9 -> 5.7 GB, PSS), so the largest files fit side by
# side (tests/memory_budget.py); 128 MB holds ~2,900 tokens of the embedded model, above its 2,048-token context.
os.environ.setdefault("CALM_KV_CACHE_MB", "128")
# As in every `calm` process (calm_core/collector.py): the test processes import torch, transformers and vLLM too.
collect_young_less_often()


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


@pytest.fixture(scope="session")
def retrained_version(tmp_path_factory, shipped_artifact) -> Path:
    """A second version: a few large CALM steps from the shipped one (another head; loop-smoke's method holds θ, so its
    adapter is the shipped one's weights under another version), its free-form mode kept, as the retraining worker
    makes them. Read only (a registry copies what it adds). Trained once per run: the files that
    serve it (adapter modes, the fleet) share it, across pytest-xdist workers too (the second waits on the lock)."""
    run = _run_dir(tmp_path_factory)
    out = run / "retrained-version"
    with open(run / "retrained-version.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_dir():  # attach_free_form writes it atomically: there only once complete
            _train_retrained_version(run / "retrained-run", shipped_artifact, out)
    return out


def _train_retrained_version(work: Path, shipped_artifact, out: Path) -> None:
    from calm_core.artifact import FREE_FORM_DIR, attach_free_form
    from training.config import load_config
    from training.trainer import Trainer

    cfg = load_config("configs/train/loop-smoke.toml", out_dir=str(work), steps=2, lr_theta=1e-2, lr_alpha=0.3,
                      init_from=str(shipped_artifact.path))
    trainer = Trainer(cfg, show_progress=False).setup()
    trainer.train()
    attach_free_form(trainer.export({}), shipped_artifact.path / FREE_FORM_DIR, out)


@pytest.fixture(scope="module")
def postgres_url():
    from tests.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory):
    """A real S3 API on this machine (moto's server) with one bucket "calm-registry": (filesystem, the AWS variables
    every S3 client here reads, also set in this process while the module runs; give them to subprocesses)."""
    from tests.servers import free_port, running

    import s3fs  # noqa: F401  (in the lock: a missing s3fs fails here, it does not skip the fleet's files)
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


# -- memory: modules whose stacks take a large part of the machine do not run together (tests/memory_budget.py) -------
def _run_dir(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run shares (a worker's base temp is a subfolder of the run's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="module", autouse=True)
def memory_budget(request, tmp_path_factory):
    """Autouse, so it runs before the module's own module-scoped fixtures start their servers. Every module's peak
    memory (its servers and engines included) is recorded for the run's summary; a module marked `memory_gb` first
    waits until its mark fits beside the other workers' marked modules."""
    run = _run_dir(tmp_path_factory)
    marker = request.node.get_closest_marker("memory_gb")
    gb = float(marker.args[0]) if marker else None
    waited = 0.0
    if gb is not None:
        budget = MemoryBudget(run / "memory-budget.json", machine_capacity_gb())
        holder = f"{os.getpid()}:{request.node.nodeid}"
        report = lambda held: print(  # noqa: E731
            f"{request.node.nodeid} ({gb} GB) waits for memory: {sorted(held)} hold "
            f"{sum(c['gb'] for c in held.values()):.1f} of {budget.capacity_gb:.1f} GB", file=sys.stderr)
        waited = budget.acquire(holder, gb, on_wait=report)
    try:
        with PeakMemory() as peak:
            yield
    finally:
        if gb is not None:
            budget.release(holder)
        with open(run / "memory-peaks.jsonl", "a") as f:
            f.write(json.dumps({"module": request.node.nodeid, "marked_gb": gb, "peak_gb": round(peak.peak_gb, 2),
                                "waited_s": round(waited, 1), "cpu_s": round(peak.cpu_s, 1),
                                "busy_processes": peak.busy_processes}) + "\n")


# -- order: the slowest files first, files that need much memory apart ----------------------------------------------
PUBLISHED_TIMES = REPO / "benchmarks" / "results" / "test-times.md"


def published_seconds() -> dict[str, float]:
    """Each file's seconds in the published run; none when there is no published run."""
    return per_file(PUBLISHED_TIMES)[1] if PUBLISHED_TIMES.is_file() else {}


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a run without pytest-xdist installed does not know it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` hands out files in the order below, one file ahead at most (tests/file_schedule.py)."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.file_schedule import OneFileAhead

    return OneFileAhead(config, log, published_seconds())


def pytest_collection_modifyitems(config, items):
    """Files in the order of their seconds in the published run (benchmarks/results/test-times.md), slowest first,
    tests within a file as written. With two pytest-xdist workers (scripts/test.sh) the longest file then starts at once
    instead of last while the other worker idles; every worker sorts alike.

    Files marked `memory_gb` are kept apart: the largest mark first (it fits beside the fewest marked files), beside
    unmarked files, the others after every unmarked file, so marked files meet only at the end, where
    tests/memory_budget.py lets the pairs that fit run together and makes the others wait. (By mark, not by seconds:
    a file's published seconds include any wait for memory.)"""
    seconds = published_seconds()
    file_of = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    # A file the published run does not list is unmeasured: it starts early, so a slow new one never starts last.
    secs = lambda item: seconds.get(file_of(item), float("inf"))  # noqa: E731
    marked = {file_of(item): float(item.get_closest_marker("memory_gb").args[0])
              for item in items if item.get_closest_marker("memory_gb")}
    first = max(marked, key=marked.get, default=None)

    def key(item):
        group = 0 if file_of(item) == first else (2 if file_of(item) in marked else 1)
        return group, -secs(item)

    items.sort(key=key)


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


def _memory_table(rows: list[dict], top: int = 15) -> str:
    """The files that took the most memory at their peak (PSS of the worker and everything it started), their marks and
    how long they waited for memory."""
    lines = ["| file | peak (GB, PSS) | marked (GB) | waited (s) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['module']} | {r['peak_gb']:.1f} | {r['marked_gb'] or ''} | {r['waited_s'] or ''} |"
              for r in sorted(rows, key=lambda r: -r["peak_gb"])[:top]]
    return "\n".join(lines) + "\n"


def _cpu_table(rows: list[dict], top: int = 20) -> str:
    """The files that used the most CPU (the worker and everything it started): with both cores busy, what a file costs
    the run's wall time is its CPU seconds, not its own wall time."""
    total = sum(r["cpu_s"] for r in rows)
    lines = [f"CPU: {total / 60:.1f} min in all", "",
             f"| file | CPU (s) | share | processes over {PeakMemory.BUSY_S:g} CPU s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['module']} | {r['cpu_s']:.0f} | {r['cpu_s'] / max(total, 1e-9):.1%} | {r['busy_processes']} |"
              for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]]
    return "\n".join(lines) + "\n"


def _probe_line(variable: str, label: str) -> str:
    """What one of scripts/test.sh's probes found before the run (it exports the line as `variable`), or nothing:
    CALM_MACHINE, the CPU the times were taken on (scripts/machine_probe.py); CALM_FAST_MEMORY, the memory that came at
    full speed, beyond which memory held was slow (scripts/memory_ceiling.py)."""
    found = os.environ.get(variable)
    return f"{label}: {found}\n\n" if found else ""


# -- the checkout's own registry is not the tests' -----------------------------------------------------------------------
# `calm serve` and `calm engine` run from this checkout read CALM_HOME's registry and its serving list; a test that
# wrote there (a gateway on a db_url without a registry_dir of its own) once made the developer's engine try to load
# the tests' version. The controller (not an xdist worker) compares the list before and after the run.
_HOME_SERVING = Path(os.environ["CALM_HOME"]) / "registry" / "serving.json"
_SERVING_STAMP = pytest.StashKey[int | None]()
_SERVING_WRITTEN = pytest.StashKey[str]()


def _home_serving_stamp() -> int | None:
    try:
        return _HOME_SERVING.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def pytest_configure(config):
    config.stash[_SERVING_STAMP] = _home_serving_stamp()


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or _home_serving_stamp() == session.config.stash[_SERVING_STAMP]:
        return
    session.config.stash[_SERVING_WRITTEN] = (
        f"{_HOME_SERVING} changed during the run: a test wrote the checkout's registry (give its gateway a "
        "registry_dir under tmp_path), or a gateway from this checkout ran beside the tests")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _write_times(terminalreporter, config)
    if _SERVING_WRITTEN in config.stash:  # last, beside the count of passed tests it contradicts
        terminalreporter.write_sep("=", "the checkout's registry was written", red=True)
        terminalreporter.write_line(config.stash[_SERVING_WRITTEN])


def _write_times(terminalreporter, config) -> None:
    if not _SECONDS:
        return
    peaks = _run_dir(config._tmp_path_factory) / "memory-peaks.jsonl"  # one row per module (the fixture above)
    rows = [json.loads(line) for line in peaks.read_text().splitlines()] if peaks.is_file() else []
    table = _probe_line("CALM_MACHINE", "Machine (`scripts/machine_probe.py`)") + _times_table() + (
        f"\nMemory per file (the peak PSS of the worker and everything it started; tests/memory_budget.py):\n\n"
        f"{_probe_line('CALM_FAST_MEMORY', 'Before the run, `scripts/memory_ceiling.py`')}{_memory_table(rows)}\n"
        f"CPU per file (the worker and everything it started, sampled every 2 s; tests/memory_budget.py):\n\n"
        f"{_cpu_table(rows)}" if rows else "")
    terminalreporter.write_sep("=", "time per file")
    terminalreporter.write(table)
    out = os.environ.get("CALM_TEST_TIMES_OUT")  # scripts/test.sh sets it (.calm/test-times.md by default)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table)


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen_per_file():
    """What is alive when a file starts (the modules imported so far, session fixtures) is out of the collector's way
    for the file: a full collection walks only what the file made. Collected first, so no garbage is frozen; the last
    failure's traceback, which pytest keeps in sys.last_* (the frames and fixture values of a test of the previous file),
    is dropped first. 6.8 -> 2.1 CPU s of full collections in the test process over tests/test_training_run.py,
    test_recalibration.py and test_offline_scoring.py (benchmarks/engines/gc_timer: docs/testing.md)."""
    for name in ("last_type", "last_value", "last_traceback"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    gc.freeze()
    yield
