"""The `calm` command line as a user runs it: bad input gives one line naming the problem, exit status 2.

Most commands run in this process through typer's runner (`calm`): a fresh interpreter costs each run its imports,
1 CPU-s and up to 7 where the command loads torch (`calm eval`, `calm jobs create`). What only a fresh process shows
stays a subprocess (`run_calm`): the one-line error and exit status through `python -m calm_cli` once its imports
ran (test_unknown_dataset, test_missing_data_file: torch and transformers imported, nothing else printed), the exit
status 1 and the settings read at start (test_a_wrong_setting_...), the help's listing, and a run from another
folder (test_a_command_that_would_create_a_database_...)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from calm_cli.main import app

REPO = Path(__file__).resolve().parents[1]
CALM = [sys.executable, "-m", "calm_cli"]


def run_calm(*args, env=None, timeout=300):
    return subprocess.run(
        [*CALM, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def calm(*args, env=None):
    """`calm ARGS` in this process, read as run_calm's result: exit status, stdout, stderr (an uncaught exception's
    traceback there, as the interpreter would print it)."""
    result = CliRunner().invoke(app, [str(a) for a in args], env=env)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(result.exception))
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=stderr)


def assert_one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in lines[0]


def test_unknown_dataset():
    assert_one_line_error(run_calm("eval", "-d", "arc_medium"), "unknown dataset 'arc_medium'")


def test_keys_jobs_and_promotions_for_a_domain_no_request_can_name_are_refused(tmp_path, shipped_artifact):
    """As the admin API refuses them: requests naming such a domain are served as 'other', so what is stored for it
    never applies. Before a gateway has registered its default version, only the spelling can be checked."""
    env = {"CALM_DB_PATH": str(tmp_path / "g.db"), "CALM_REGISTRY_DIR": str(tmp_path / "registry")}
    assert_one_line_error(calm("keys", "create", "--name", "t", "--domain", "Medicine", env=env),
                          "domain 'Medicine': a domain is lower-case letters")
    assert calm("jobs", "create", "geo", env=env).returncode == 0  # no default version yet: not checkable
    from calm_core.registry import Registry
    from gateway.records.store import Store

    store = Store(f"sqlite:///{tmp_path / 'g.db'}")
    version = Registry(store, tmp_path / "registry").ensure_default(shipped_artifact.path)
    store.close()
    for argv in (("keys", "create", "--name", "t", "--domain", "legal"), ("jobs", "create", "legal"),
                 ("artifacts", "promote", version, "--domain", "legal"), ("jobs", "create", "other")):
        assert_one_line_error(calm(*argv, env=env), "is not a domain this gateway serves")
    assert calm("jobs", "create", "medicine", env=env).returncode == 0  # a reference domain of the artifact
    assert calm("keys", "create", "--name", "t", "--domain", "legal", env={**env, "CALM_DOMAINS": '["legal"]'}).returncode == 0


def test_an_artifact_made_outside_the_loop_is_registered_with_its_lineage_and_promoted(tmp_path, shipped_artifact):
    """`calm artifacts recalibrate` writes a folder; `calm artifacts add` is how it reaches the registry the gateways
    follow (promote alone refused it: "no artifact version ... in the registry")."""
    import json as json_

    from calm_core.artifact import Recalibration, derive_version
    from calm_core.registry import Registry
    from gateway.records.store import Store

    env = {"CALM_DB_PATH": str(tmp_path / "g.db"), "CALM_REGISTRY_DIR": str(tmp_path / "registry")}
    store = Store(f"sqlite:///{tmp_path / 'g.db'}")
    registry = Registry(store, tmp_path / "registry")
    default = registry.ensure_default(shipped_artifact.path)  # what a gateway does at start
    lineage = Recalibration(parent=default, domain="science", temperature=1.3, fitted_on="78 labels",
                            held_out={"ece_before": 0.057, "ece_after": 0.048})
    child = derive_version(shipped_artifact.path, tmp_path / "recalibrated", "recalibrated", option_temperature=1.3,
                           recalibration=lineage.model_dump()).artifact_version
    added = calm("artifacts", "add", str(tmp_path / "recalibrated"), env=env)
    assert added.returncode == 0, added.stderr
    assert f"{child}: registered (candidate, domain=science, parent={default})" in added.stdout
    assert f"calm artifacts promote {child} --domain science" in added.stdout
    record = json_.loads(calm("artifacts", "show", child, env=env).stdout)
    folder = json_.loads(calm("artifacts", "show", str(tmp_path / "recalibrated"), env=env).stdout)
    assert folder["artifact_version"] == child and folder["recalibration"]["parent"] == default
    # `calm artifact`, the folder commands' group before the merge, is the same group under its old name, unlisted
    assert json_.loads(calm("artifact", "show", child, env=env).stdout) == record
    rows = run_calm("--help").stdout.splitlines()
    listed = [row.split()[1] for row in rows if row.startswith("│ ") and row[2] != " "]  # a command's first line
    assert "artifacts" in listed and "artifact" not in listed
    assert record["trigger"] == "import" and record["metrics"]["recalibration"]["ece_after"] == 0.048
    assert Path(record["path"]).parent == tmp_path / "registry"  # a copy: the folder it came from may go
    promoted = calm("artifacts", "add", str(tmp_path / "recalibrated"), "--promote", env=env)
    assert f"{child}: already registered" in promoted.stdout
    assert f"science: {child} (was the default)" in promoted.stdout
    assert registry.active() == {"*": default, "science": child}

    for manifest in (tmp_path / "recalibrated").rglob("manifest.json"):  # the version and the free-form mode inside
        other = json_.loads(manifest.read_text())
        other["base_model"]["weights_sha256"] = "0" * 64
        if manifest.parent == tmp_path / "recalibrated":
            other["artifact_version"] = "recalibrated-other-weights"
        manifest.write_text(json_.dumps(other))
    assert_one_line_error(calm("artifacts", "add", str(tmp_path / "recalibrated"), env=env),
                          "recalibrated-other-weights was trained on SmolLM2-135M-Instruct (0000000000000000…); "
                          "the gateways serve SmolLM2-135M-Instruct")
    assert_one_line_error(calm("artifacts", "add", str(tmp_path / "none"), env=env), "manifest.json is missing")
    assert registry.get("recalibrated-other-weights") is None
    store.close()


def test_a_status_filter_that_names_no_status_is_refused(tmp_path):
    """A misspelt --status would list nothing, as if the registry held no such version (the admin API refuses it)."""
    env = {"CALM_DB_PATH": str(tmp_path / "g.db"), "CALM_REGISTRY_DIR": str(tmp_path / "registry")}
    assert_one_line_error(calm("artifacts", "list", "--status", "actve", env=env),
                          "--status 'actve': a status is one of candidate, active, rejected, retired")
    assert_one_line_error(calm("jobs", "list", "--status", "done", env=env), "a status is one of queued, running")
    assert calm("jobs", "list", "--status", "awaiting_operator", env=env).returncode == 0


def test_a_review_names_the_option_its_withheld_letter_stands_for():
    from gateway.records.handoff_store import Review

    request = {"messages": [{"role": "user", "content": "Which nerve innervates the deltoid?"}],
               "options": ["Axillary", "Radial", "Median", "Ulnar"]}

    def option(answer: str, req: dict = request) -> str | None:
        return Review("rev-1", "medicine", "chatcmpl-1", req, answer, 0.3, 0.0).answer_option

    assert [option(letter) for letter in "ADE"] == ["Axillary", "Ulnar", None]
    assert option("The axillary nerve.") is None and option("A", {"prompt": "x"}) is None and option("") is None


def test_a_wrong_setting_is_named_and_an_unreachable_database_is_one_line(tmp_path):
    assert_one_line_error(run_calm("jobs", "list", env={"CALM_KV_CACHE_MB": "abc"}),
                          "invalid settings: CALM_KV_CACHE_MB: Input should be a valid integer")
    down = run_calm("keys", "list", env={"CALM_DB_URL": "postgresql://calm:secret@127.0.0.1:1/calm"})
    lines = [line for line in down.stderr.splitlines() if line.strip()]
    assert down.returncode == 1 and len(lines) == 1, down.stderr
    assert lines[0].startswith("error: cannot reach the gateway's database: connection failed") and "secret" not in lines[0]


def test_missing_data_file(tmp_path):
    proc = run_calm("eval", "-d", "arc_easy", env={"CALM_DATA_DIR": str(tmp_path)})
    assert_one_line_error(proc, "data file not found")


def test_malformed_jsonl_line(tmp_path, shared_data):
    (tmp_path / "arc_easy").mkdir()
    lines = (shared_data / "arc_easy/arc_easy_test.jsonl").read_text().split("\n")[:5]
    lines[3] = lines[3][:40]
    (tmp_path / "arc_easy/arc_easy_test.jsonl").write_text("\n".join(lines) + "\n")
    proc = calm("eval", "-d", "arc_easy", env={"CALM_DATA_DIR": str(tmp_path)})
    assert_one_line_error(proc, "arc_easy_test.jsonl:4: malformed JSON")


def test_no_dataset_named():
    assert_one_line_error(calm("eval"), "name at least one --dataset")


def test_missing_artifact(tmp_path):
    """`calm artifacts show` takes a folder or a registry version's name: a folder without a manifest is no artifact,
    and what names neither is refused as neither."""
    env = {"CALM_DB_PATH": str(tmp_path / "g.db"), "CALM_REGISTRY_DIR": str(tmp_path / "registry")}
    (tmp_path / "empty").mkdir()
    assert_one_line_error(calm("artifacts", "show", str(tmp_path / "empty"), env=env), "manifest.json is missing")
    # a mistyped folder is a folder (a version's name has no "/"): refused as one, no database opened or created
    assert_one_line_error(calm("artifacts", "show", str(tmp_path / "none"), env=env), "manifest.json is missing")
    assert not (tmp_path / "g.db").exists()
    assert_one_line_error(calm("artifacts", "show", "calm_head-nosuch", env=env),
                          "is neither an artifact folder nor a version in the registry")


@pytest.mark.slow
def test_mismatched_alpha_head_is_refused(tmp_path, embedded_model_dir):
    from calm_core.alpha_head import AlphaHead
    from calm_core.artifact import BaseModelRef, TokenizerRef, save_artifact

    save_artifact(
        tmp_path / "wrong", AlphaHead.identity(1000), method="identity",
        base_model=BaseModelRef(id="other", weights_sha256="0" * 64), tokenizer=TokenizerRef(sha256="1" * 64, vocab_size=1000),
    )
    proc = calm("eval", "-d", "arc_easy", "--limit", "4", "--artifact", str(tmp_path / "wrong"), "--out", str(tmp_path / "r"))
    assert_one_line_error(proc, "covers 1000 tokens but the model's vocabulary has 49152")


@pytest.mark.slow
def test_eval_refuses_to_score_an_artifact_in_another_format(tmp_path, embedded_model_dir, shipped_artifact):
    proc = calm("eval", "-d", "arc_easy", "--limit", "4", "--artifact", str(shipped_artifact.path),
                    "--answer-format", "letter", "--out", str(tmp_path / "r"))
    assert_one_line_error(proc, "is fitted on cloze scoring")


@pytest.mark.slow
def test_eval_writes_report_and_identity_head_changes_nothing(tmp_path, embedded_model_dir, shared_data):
    assert calm("artifacts", "identity", "--no-reference", "--out", str(tmp_path / "id")).returncode == 0
    # 8 questions (24 before): the identity head leaves each question's NLL as it is (1e-9), which any number shows;
    # n and the report's row show --limit is kept.
    base = calm("eval", "-d", "arc_easy:dev", "--limit", "8", "--out", str(tmp_path / "plain"))
    assert base.returncode == 0, base.stderr
    with_head = calm("eval", "-d", "arc_easy:dev", "--limit", "8", "--artifact", str(tmp_path / "id"),
                     "--out", str(tmp_path / "head"))
    assert with_head.returncode == 0, with_head.stderr
    plain = json.loads((tmp_path / "plain/report.json").read_text())
    headed = json.loads((tmp_path / "head/report.json").read_text())
    m = plain["results"]["arc_easy:dev"]
    assert m["n"] == 8 and 0 <= m["accuracy"] <= 1 and 0 <= m["ece_10"] <= 1
    assert headed["artifact"].startswith("identity-")
    assert headed["results"]["arc_easy:dev"]["nll"] == pytest.approx(m["nll"], abs=1e-9)
    assert (tmp_path / "plain/reliability.png").stat().st_size > 10_000
    assert "| arc_easy:dev | 8 |" in (tmp_path / "plain/report.md").read_text()


def test_open_ended_sets_are_named_by_a_whole_range_and_evaluated_alone(tmp_path):
    """(Their evaluation's report: tests/test_gateway_default.py, test_free_form_eval_of_the_shipped_mode_...)"""
    assert_one_line_error(calm("eval", "-d", "popqa:test@0.5", "--out", str(tmp_path / "x")), "name:split@0.7-0.8")
    assert_one_line_error(calm("eval", "-d", "popqa:test", "-d", "arc_easy", "--out", str(tmp_path / "x")),
                          "evaluated alone")


def test_a_command_that_would_create_a_database_nobody_named_says_so(tmp_path):
    """`calm keys create` run outside the checkout printed a key into a new .calm/gateway.sqlite3 there, which the
    gateway (reading the checkout's) then refused with a 401, and nothing said why (65)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CALM_DB_PATH", "CALM_DB_URL")}
    run = lambda: subprocess.run([*CALM, "keys", "create", "--name", "elsewhere"], cwd=tmp_path,  # noqa: E731
                                 capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": str(REPO)})
    first, second = run(), run()
    assert first.returncode == 0 and first.stdout.startswith("calm-"), first.stderr
    assert f"no gateway database at {tmp_path / '.calm' / 'gateway.sqlite3'}" in first.stderr
    assert "CALM_DB_PATH" in first.stderr and (tmp_path / ".calm" / "gateway.sqlite3").exists()
    assert second.returncode == 0 and "warning" not in second.stderr  # the same folder's database, now there


def test_a_calm_command_collects_its_young_generation_less_often():
    """Set before any command's heavy imports (calm_core/collector.py); CPython's own would be 700."""
    from calm_core.collector import YOUNG_GENERATION_THRESHOLD
    from tests.servers import python

    assert int(python("import gc, calm_cli.main; print(gc.get_threshold()[0])")) == YOUNG_GENERATION_THRESHOLD
